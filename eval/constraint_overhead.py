"""Per-token cost of constrained decoding at a 49k vocabulary (the embedded model's tokenizer), batch 1, CPU: the
logits processor's call once the masks of the states met are cached, against the first visit of each state.

    python -m tinyloop_hf.eval.constraint_overhead [--threads 1]

Each pattern is decoded along a fixed text it matches; the cached cost is the median of repeated calls over the
same prefixes (state lookup by prefix, gather of the packed mask row, unpack, fill).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer

from tinyloop_hf import embedded_model_path
from tinyloop_hf.constraints.constrained import ConstrainedLogitsProcessor, compiled_constraint

from .flags import at_least

CASES = [
    (r" (yes|no), my lord\.", " no, my lord."),
    (r" \d{3}-\d{4}", " 555-1234"),
    (r'\{"name": "[a-zA-Z ]{1,20}", "age": [0-9]{1,3}\}', '{"name": "Hamlet", "age": 30}'),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=at_least(0), default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--repeats", type=at_least(1), default=200)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    vocab = 49152
    scores = torch.randn(1, vocab)
    print(f"torch threads {torch.get_num_threads()}, vocabulary {vocab}")
    print("| pattern | tokens | first visit ms / token | cached us / token |")
    print("|---|---|---|---|")
    for pattern, text in CASES:
        compiled = compiled_constraint(pattern, tokenizer, [tokenizer.eos_token_id], vocab)
        tokens = tokenizer(text).input_ids
        prefixes = [torch.tensor([tokens[:i]]) for i in range(len(tokens) + 1)]
        processor = ConstrainedLogitsProcessor(compiled)
        processor.prompt_length = 0
        start = time.perf_counter()
        for prefix in prefixes:
            processor(prefix, scores)
        first = (time.perf_counter() - start) / len(prefixes) * 1000
        per_call = []
        for _ in range(args.repeats):
            for prefix in prefixes:
                start = time.perf_counter()
                processor(prefix, scores)
                per_call.append(time.perf_counter() - start)
        cell = pattern.replace("|", "\\|")  # a bare | would split the Markdown cell, even in a code span
        print(f"| `{cell}` | {len(prefixes)} | {first:.1f} | {statistics.median(per_call) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
