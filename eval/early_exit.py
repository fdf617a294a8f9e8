"""Adaptive early exit on the embedded model: loop compute saved against quality lost, per criterion and threshold.

    python -m tinyloop_hf.eval.early_exit --out eval/results/early-exit-embedded

Held-out windows (a batch of --windows rows): the first --context tokens are the prompt (every loop), the next
--steps tokens are decoded one at a time, teacher-forced, with the exit rule on; each step's loops_run is counted.
Quality: perplexity of the true next tokens over the decoded steps, and how often the top-1 token equals the
full-depth model's. Fixed shallower depths are listed for comparison.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from tinyloop_hf import TinyLoopForCausalLM, embedded_model_path

from .flags import at_least
from .reports import write_report

SETTINGS: list[dict[str, Any]] = [
    {"early_exit": "gate", "early_exit_threshold": t} for t in (0.3, 0.5, 0.7, 0.9)
] + [
    {"early_exit": "state_delta", "early_exit_threshold": t} for t in (0.05, 0.1, 0.2, 0.3)
] + [
    {"early_exit": "kl", "early_exit_threshold": t} for t in (0.01, 0.05, 0.2, 0.5)
]  # fmt: skip


def decode(model: TinyLoopForCausalLM, ids: torch.Tensor, context: int, **fields: Any) -> dict[str, Any]:
    """Teacher-forced decode steps after a full-depth prompt: NLL, loops run and top-1 per step."""
    cache = model.new_cache()
    nll, loops, top1 = [], [], []
    with torch.no_grad():
        logits = model(ids[:, :context], past_key_values=cache, use_cache=True).logits[:, -1]
        for t in range(context, ids.shape[1] - 1):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **fields)
            logits = out.logits[:, -1].float()
            nll.append(torch.nn.functional.cross_entropy(logits, ids[:, t + 1], reduction="none"))
            top1.append(logits.argmax(-1))
            run = out.loops_run if out.loops_run is not None else torch.full_like(ids[:, 0], fields.get("num_loops", 4))
            loops.append(run.float())
    return {"nll": torch.stack(nll, 1), "loops": torch.stack(loops, 1), "top1": torch.stack(top1, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=at_least(1), default=8)
    parser.add_argument("--context", type=at_least(1), default=64)
    parser.add_argument("--steps", type=at_least(1), default=96)
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes OUT.md and OUT.json")
    args = parser.parse_args(argv)
    directory = embedded_model_path()
    model = TinyLoopForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = tokenizer((directory / "heldout_sample.txt").read_text(), return_tensors="pt").input_ids[0]
    span = args.context + args.steps + 1
    stride = (len(text) - span) // args.windows
    ids = torch.stack([text[i * stride : i * stride + span] for i in range(args.windows)])
    full_loops = model.config.num_loops
    reference = decode(model, ids, args.context)
    rows = []
    settings = [{"num_loops": d} for d in range(1, full_loops + 1)] + SETTINGS
    for fields in settings:
        result = reference if fields == {"num_loops": full_loops} else decode(model, ids, args.context, **fields)
        mean_loops = float(result["loops"].mean())
        rows.append({
            **fields,
            "mean_loops": mean_loops,
            "loop_compute_saved": 1 - mean_loops / full_loops,
            "perplexity": math.exp(float(result["nll"].mean())),
            "top1_agreement_with_full_depth": float((result["top1"] == reference["top1"]).float().mean()),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    header = (
        f"Embedded model (L = {full_loops}), {args.windows} held-out windows decoded as one batch: "
        f"{args.context}-token prompt at full depth, then {args.steps} teacher-forced decode steps with the rule on. "
        f"Loop compute saved = 1 - mean loops run / L over the decode steps (prelude, coda and head always run)."
    )
    lines = ["| setting | mean loops | loop compute saved | perplexity | top-1 = full depth |",
             "|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        setting = (f"num_loops={row['num_loops']} (fixed)" if "num_loops" in row
                   else f"early_exit={row['early_exit']}, threshold {row['early_exit_threshold']}")  # fmt: skip
        lines.append(f"| {setting} | {row['mean_loops']:.2f} | {100 * row['loop_compute_saved']:.0f}% | "
                     f"{row['perplexity']:.2f} | {100 * row['top1_agreement_with_full_depth']:.0f}% |")  # fmt: skip
    write_report(args.out, header, lines, rows)


if __name__ == "__main__":
    main()
