"""tinyloop-generate: generate from one model at several loop depths and time each depth.

The loop depth is a runtime argument: the same loaded model answers at every depth, nothing is reloaded.
Without --model it runs the small looped model embedded in the package (offline, on the CPU). The decoding fields
(self-speculation, early exit, constraints) can be given too, e.g. --draft-loops 1 or --regex ' (yes|no)\\.'.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from .embedded import embedded_model_path
from .modeling_tinyloop import TinyLoopForCausalLM


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tinyloop-generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a TinyLoop checkpoint directory (default: the embedded model)")
    parser.add_argument("--prompt", default="To be, or not to be", help="text to continue")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--loops", type=int, nargs="+", help="loop depths to run (default: 1 .. the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample", action="store_true", help="sample (seed 0) instead of greedy decoding")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    decoding = parser.add_argument_group("decoding fields (generation_config; see README)")
    decoding.add_argument("--draft-loops", type=int, help="self-speculative decoding: draft depth")
    decoding.add_argument("--num-draft-tokens", help="draft tokens per round: a number or 'adaptive'")
    decoding.add_argument("--early-exit", choices=["gate", "state_delta", "kl"], help="per-token early exit")
    decoding.add_argument("--early-exit-threshold", type=float)
    decoding.add_argument("--regex", help="constrain the output to this regex")
    decoding.add_argument("--choices", nargs="+", help="constrain the output to one of these strings")
    decoding.add_argument("--json-schema", help="constrain the output to JSON matching this schema (JSON text)")
    return parser.parse_args(argv)


def decoding_fields(args: argparse.Namespace) -> dict[str, object]:
    """The decoding fields given on the command line (generate() validates them and names any bad one)."""
    tokens = args.num_draft_tokens
    fields = {
        "draft_loops": args.draft_loops,
        "num_draft_tokens": int(tokens) if tokens is not None and tokens.isdigit() else tokens,
        "early_exit": args.early_exit,
        "early_exit_threshold": args.early_exit_threshold,
        "regex": args.regex,
        "choices": args.choices,
        "json_schema": args.json_schema,
    }
    return {name: value for name, value in fields.items() if value is not None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except ValueError as error:  # bad fields and depths, named by generate() / the model
        print(f"tinyloop-generate: error: {error}", file=sys.stderr)
        return 2


def _tokenizer(directory: Any) -> Any:
    if not any((Path(directory) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"{directory} has no tokenizer files (tokenizer.json / tokenizer_config.json): copy the source model's "
            "tokenizer into it (tinyloop-convert copies it when the source has one)"
        )
    return AutoTokenizer.from_pretrained(directory)


def _run(args: argparse.Namespace) -> int:
    directory = args.model or embedded_model_path()
    tokenizer = _tokenizer(directory)
    model = TinyLoopForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype)).eval()
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    # A chat template writes its own special tokens (BOS): the tokenizer must not add them again.
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not args.chat)
    fields = decoding_fields(args)
    if fields.keys() & {"regex", "choices", "json_schema"}:
        fields["tokenizer"] = tokenizer
    # Speculation drafts below the verifier's depth: by default it runs at the model's own depth only.
    default_depths = {1, 2, model.config.num_loops, 2 * model.config.num_loops}
    if args.draft_loops is not None:
        default_depths = {model.config.num_loops}
    depths = args.loops or sorted(default_depths & set(range(1, model.config.max_loops + 1)))
    config = model.config
    print(
        f"model: prelude/loop/coda = {config.num_prelude_layers}/{config.num_loop_layers}/{config.num_coda_layers} "
        f"layers, default num_loops {config.num_loops}, max {config.max_loops}; prompt: {args.prompt!r}\n"
    )
    for depth in depths:
        torch.manual_seed(0)
        start = time.perf_counter()
        output = model.generate(
            **inputs,
            num_loops=depth,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.sample,
            pad_token_id=tokenizer.pad_token_id,
            **fields,
        )
        seconds = time.perf_counter() - start
        new = output[0, inputs.input_ids.shape[1] :]
        text = tokenizer.decode(new, skip_special_tokens=True)
        extra = ""
        if args.draft_loops is not None:
            stats = model.speculation_stats
            extra = f", drafts at {stats.draft_loops} loops: {stats.acceptance_rate:.0%} accepted"
        print(f"--- num_loops={depth}  ({len(new)} tokens, {len(new) / seconds:.1f} tok/s{extra})\n{text.strip()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
