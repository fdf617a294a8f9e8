"""Loaders for the offline lm-eval tasks in this folder (no hub access: the data ships with the package)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from datasets import Dataset

HERE = Path(__file__).parent


def load_mc(**_: Any) -> dict[str, Dataset]:
    rows = [json.loads(line) for line in (HERE / "mc.jsonl").read_text().splitlines() if line.strip()]
    return {"test": Dataset.from_list(rows)}


def load_ppl(**_: Any) -> dict[str, Dataset]:
    paragraphs = [part.strip() for part in (HERE / "ppl.txt").read_text().split("\n\n") if part.strip()]
    return {"test": Dataset.from_list([{"text": paragraph} for paragraph in paragraphs])}


def ppl_results(doc: dict[str, Any], results: list[Any]) -> dict[str, tuple[float, int]]:
    (loglikelihood,) = results
    text = doc["text"]
    return {
        "word_perplexity": (loglikelihood, len(text.split())),
        "byte_perplexity": (loglikelihood, len(text.encode("utf-8"))),
        "bits_per_byte": (loglikelihood, len(text.encode("utf-8"))),
    }
