"""Self-speculative decoding on the embedded model: acceptance rate, tokens per round and speed against plain
decoding measured in the same process, greedy (output checked identical) and sampling.

    python -m tinyloop_hf.eval.speculation --out eval/results/speculation-embedded

Prompts are windows of the held-out text that ships with the embedded model. Speed is wall time of generate()
(best of --repeats) on the chosen device; on a CPU with this small model a forward costs about the same whatever
its token count, so the speed-up follows forwards saved more than loops saved.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from tinyloop_hf import TinyLoopForCausalLM, embedded_model_path

from .flags import at_least
from .gpu import require_gpu
from .reports import write_report


def prompts(tokenizer: Any, count: int, length: int) -> list[torch.Tensor]:
    ids = tokenizer((embedded_model_path() / "heldout_sample.txt").read_text()[20000:], return_tensors="pt").input_ids
    step = (ids.shape[1] - length) // count
    return [ids[:, i * step : i * step + length] for i in range(count)]


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _draft_tokens(text: str) -> str:
    if text != "adaptive":
        at_least(1)(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=at_least(1), default=8)
    parser.add_argument("--prompt-length", type=at_least(1), default=32)
    parser.add_argument("--new-tokens", type=at_least(1), default=64)
    parser.add_argument("--draft-loops", type=at_least(1), nargs="+", default=[1, 2, 3])
    parser.add_argument("--draft-tokens", type=_draft_tokens, nargs="+", default=["2", "4", "adaptive"],
                        help="numbers of draft tokens, or adaptive")  # fmt: skip
    parser.add_argument("--repeats", type=at_least(1), default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cuda-path", action="store_true", help="bf16 on the CUDA path (graph-replayed steps)")
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes OUT.md and OUT.json")
    args = parser.parse_args(argv)
    if args.cuda_path:  # the CUDA path runs on the GPU: --cuda-path implies --device cuda
        require_gpu("python -m tinyloop_hf.eval.speculation --cuda-path")
        args.device = "cuda"
    torch.manual_seed(0)
    directory = embedded_model_path()
    dtype = torch.bfloat16 if args.cuda_path else torch.float32
    model = TinyLoopForCausalLM.from_pretrained(directory, dtype=dtype).to(args.device).eval()
    if args.cuda_path:
        model.use_cuda_path()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = prompts(tokenizer, args.prompts, args.prompt_length)
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
    rows: list[dict[str, Any]] = []

    def run(mode: str, **extra: Any) -> tuple[float, list[torch.Tensor]]:
        sample = mode == "sample"
        if sample:
            torch.manual_seed(0)

        def generate_all() -> list[torch.Tensor]:
            return [model.generate(ids.to(args.device), do_sample=sample, **common, **extra) for ids in batch]

        return timed(generate_all, args.repeats)

    for mode in ("greedy", "sample"):
        plain_seconds, plain = run(mode)
        for draft_loops in args.draft_loops:
            for tokens in args.draft_tokens:
                draft_tokens = tokens if tokens == "adaptive" else int(tokens)
                seconds, outputs = run(mode, draft_loops=draft_loops, num_draft_tokens=draft_tokens)
                stats = model.speculation_stats  # of the last prompt: recompute over all prompts below
                accepted = drafted = emitted = rounds = 0
                for ids in batch:  # statistics over every prompt (one untimed pass)
                    if mode == "sample":
                        torch.manual_seed(0)
                    model.generate(ids.to(args.device), do_sample=mode == "sample", draft_loops=draft_loops,
                                   num_draft_tokens=draft_tokens, **common)  # fmt: skip
                    stats = model.speculation_stats
                    accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
                    emitted, rounds = emitted + stats.emitted, rounds + stats.rounds
                identical = all(torch.equal(a, b) for a, b in zip(outputs, plain, strict=True))
                rows.append({
                    "mode": mode, "draft_loops": draft_loops, "num_draft_tokens": draft_tokens,
                    "acceptance": accepted / max(drafted, 1), "tokens_per_round": emitted / max(rounds, 1),
                    "speedup": plain_seconds / seconds, "plain_tok_s": len(batch) * args.new_tokens / plain_seconds,
                    "spec_tok_s": len(batch) * args.new_tokens / seconds,
                    "identical_to_plain": identical if mode == "greedy" else None,
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    header = (
        f"Embedded model (L = {model.config.num_loops}), {len(batch)} held-out prompts of {args.prompt_length} tokens, "
        f"{args.new_tokens} new tokens each, batch 1, {args.device}, {str(dtype).removeprefix('torch.')}"
        f"{' (CUDA path)' if args.cuda_path else ''}; plain decoding measured in the same process."
    )
    columns = "mode|draft loops|draft tokens|acceptance|tokens / round|plain tok/s|speculative tok/s|speed-up|identical"
    columns = columns.split("|")
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        same = {True: "yes", False: "NO", None: "n/a (sampling)"}[row["identical_to_plain"]]
        lines.append(
            f"| {row['mode']} | {row['draft_loops']} | {row['num_draft_tokens']} | {row['acceptance']:.2f} | "
            f"{row['tokens_per_round']:.2f} | {row['plain_tok_s']:.1f} | {row['spec_tok_s']:.1f} | "
            f"{row['speedup']:.2f}x | {same} |"
        )
    write_report(args.out, header, lines, rows)


if __name__ == "__main__":
    main()
