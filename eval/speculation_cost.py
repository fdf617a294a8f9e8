"""What self-speculation's machinery costs on the CUDA path at the Ouro-1.4B shape (INT4, L = 4, batch 1), against
plain decoding in the same process. The weights are random, so acceptance says nothing about a trained model except
at draft_loops = num_loops: there every draft is the verifier's own choice, and tokens per second show the overhead
of drafting token by token and verifying k + 1 tokens at once. draft_loops = 1 shows a round's cost when drafts
are rejected.

    python -m tinyloop_hf.eval.speculation_cost --new-tokens 64
"""

from __future__ import annotations

import argparse

import torch

from .bench import base_model, build_ours, timed
from .gpu import require_gpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 7])
    args = parser.parse_args(argv)
    require_gpu("python -m tinyloop_hf.eval.speculation_cost")
    base = base_model(4, 4096)
    model = build_ours(base, args.bits).use_cuda_path()
    del base
    ids = torch.randint(1, 49152, (1, args.context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                  eos_token_id=None)  # fmt: skip

    def tok_s(**extra) -> float:
        model.generate(ids, **common, **extra)  # warm-up: graphs of every key this run meets
        model.generate(ids, **common, **extra)
        return args.new_tokens / min(timed(lambda: model.generate(ids, **common, **extra)) for _ in range(2))

    plain = tok_s()
    print(f"Ouro-1.4B shape, INT{args.bits}, L = 4, batch 1, prompt {args.context}, {args.new_tokens} new tokens, "
          f"greedy, random weights; plain decoding {plain:.1f} tok/s\n")  # fmt: skip
    print("| draft loops | draft tokens | acceptance | tokens / round | tok/s | vs plain |")
    print("|---|---|---|---|---|---|")
    for draft_loops in (4, 1):
        for draft_tokens in args.draft_tokens:
            speed = tok_s(draft_loops=draft_loops, num_draft_tokens=draft_tokens)
            stats = model.speculation_stats
            print(f"| {draft_loops} | {draft_tokens} | {stats.acceptance_rate:.2f} | {stats.tokens_per_round:.2f} | "
                  f"{speed:.1f} | {speed / plain:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
