"""Train the embedded TinyLoop model (prelude 1 + loop block 2 + coda 1, hidden 192) on prepare_data.py's tokens.

Each step runs a random depth T in [1, --max-train-loops]; the loss is the cross-entropy after loop T plus
--shallow-weight times the mean over the earlier loops: every depth stays a usable model (self-speculative
drafting and early exit rely on that) while the deepest loop carries most of the weight. The exit gate learns, per token
and loop, whether one more loop still lowers that token's loss by at least --gate-margin nats (a stop/continue
label from the realised improvement, as in Ouro's second gate stage). On a GPU:

    PYTHONPATH=. python examples/embedded_model/train.py --data data/ --out out/ --steps 1600

Writes the best held-out checkpoint's state dict as safetensors parts of at most 15 MB (the device tool returns
files of up to 16 MB; assemble.py joins them), config.json and training_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tinyloop_hf import TinyLoopConfig, TinyLoopForCausalLM


def model_config(vocab_size: int, eos: int, pad: int) -> TinyLoopConfig:
    return TinyLoopConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=512,
        num_attention_heads=3,
        num_key_value_heads=3,
        num_prelude_layers=1,
        num_loop_layers=2,
        num_coda_layers=1,
        num_loops=4,
        max_loops=16,
        block_norm="post_residual",
        final_norm="before_and_after_coda",
        input_injection="linear_concat",
        initial_state="zeros",
        exit_gate=True,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def batches(tokens: np.ndarray, batch: int, length: int, generator: np.random.Generator, device: str):
    while True:
        starts = generator.integers(0, len(tokens) - length - 1, batch)
        window = np.stack([tokens[start : start + length] for start in starts]).astype(np.int64)
        yield torch.from_numpy(window).to(device, non_blocking=True)


def per_loop_losses(model: TinyLoopForCausalLM, ids: torch.Tensor, loops: int):
    """Cross-entropy [T, B, S-1] of the logits read out after each loop, and the gate logits [B, S, T]."""
    output = model.model(ids, num_loops=loops, output_hidden_states=True)
    losses = []
    for state in output.hidden_states[1:]:
        logits = model.logits_from_state(state)[:, :-1]
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none"))
    return torch.stack(losses).view(loops, *ids[:, 1:].shape), output.gate_logits


def gate_loss(losses: torch.Tensor, gate_logits: torch.Tensor, margin: float) -> torch.Tensor:
    """BCE: exit after loop t (label 1) when loop t+1 lowers this token's loss by less than ``margin``."""
    if losses.shape[0] < 2:
        return losses.new_zeros(())
    improvement = (losses[:-1] - losses[1:]).detach()  # [T-1, B, S-1]
    labels = (improvement < margin).float().permute(1, 2, 0)  # [B, S-1, T-1]
    return F.binary_cross_entropy_with_logits(gate_logits[:, :-1, :-1].float(), labels)


@torch.no_grad()
def evaluate(
    model: TinyLoopForCausalLM,
    heldout: np.ndarray,
    length: int,
    depths: list[int],
    device: str,
    windows: int | None = 64,
) -> dict[int, float]:
    """Held-out perplexity per depth over the first ``windows`` windows (None: the whole held-out split)."""
    model.eval()
    count = len(heldout) // length if windows is None else min(windows, len(heldout) // length)
    ids = torch.from_numpy(heldout[: count * length].astype(np.int64).reshape(count, length)).to(device)
    result = {}
    for depth in depths:
        total = 0.0
        for start in range(0, count, 16):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                logits = model(ids[start : start + 16], num_loops=depth).logits
            total += F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), ids[start : start + 16, 1:].flatten(), reduction="sum"
            ).item()
        result[depth] = math.exp(total / (count * (length - 1)))
    model.train()
    return result


def save_parts(state: dict[str, torch.Tensor], out: Path, limit: int = 15 * 2**20) -> None:
    """Split tensors larger than ``limit`` along dim 0 ("name::i/k") and pack the pieces into files <= limit."""
    pieces: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        count = max(1, math.ceil(tensor.numel() * tensor.element_size() / limit))
        for index, piece in enumerate(tensor.chunk(count, dim=0)):
            pieces[f"{name}::{index}/{count}" if count > 1 else name] = piece.contiguous()
    files, current, size = [], {}, 0
    for name, piece in pieces.items():
        nbytes = piece.numel() * piece.element_size()
        if current and size + nbytes > limit:
            files.append(current)
            current, size = {}, 0
        current[name], size = piece, size + nbytes
    files.append(current)
    for index, tensors in enumerate(files):
        save_file(tensors, str(out / f"part-{index}.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--max-train-loops", type=int, default=6)
    parser.add_argument("--shallow-weight", type=float, default=0.1)
    parser.add_argument("--gate-margin", type=float, default=0.05)
    parser.add_argument("--gate-weight", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    train = np.fromfile(args.data / "train.bin", dtype=np.uint16)
    heldout = np.fromfile(args.data / "heldout.bin", dtype=np.uint16)
    config = model_config(vocab_size=49152, eos=0, pad=0)
    model = TinyLoopForCausalLM(config).to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device == "cuda",
    )
    schedule = lambda step: min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = np.random.default_rng(args.seed)
    stream = batches(train, args.batch, args.length, generator, device)
    log, best, best_state, start = [], float("inf"), None, time.time()
    depths = [1, 2, 3, 4, 6, 8, 12, 16]
    for step in range(args.steps):
        loops = int(generator.integers(1, args.max_train_loops + 1))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            losses, gates = per_loop_losses(model, next(stream), loops)
            lm = losses[-1].mean()
            if loops > 1:
                lm = lm + args.shallow_weight * losses[:-1].mean()
            loss = lm + args.gate_weight * gate_loss(losses, gates, args.gate_margin)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 50 == 0:
            print(
                f"step {step} loops {loops} lm {lm.item():.3f} loss {loss.item():.3f} {time.time() - start:.0f}s",
                flush=True,
            )
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            perplexities = evaluate(model, heldout, args.length, depths, device)
            log.append({"step": step + 1, "seconds": round(time.time() - start, 1), "heldout_ppl": perplexities})
            print(json.dumps(log[-1]), flush=True)
            if perplexities[config.num_loops] < best:
                best = perplexities[config.num_loops]
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    final = evaluate(model, heldout, args.length, depths, device, windows=None)
    print(json.dumps({"best_checkpoint_full_heldout_ppl": final}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    best_state.pop("lm_head.weight", None)  # tied to the embedding
    save_parts(best_state, args.out)
    config.save_pretrained(args.out)
    for shim in ("configuration_tinyloop.py", "modeling_tinyloop.py"):
        (args.out / shim).unlink(missing_ok=True)  # only weights, config and the log travel back
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "train_tokens": int(len(train)),
        "heldout_tokens": int(len(heldout)),
        "best_heldout_ppl_at_default_depth": best,
        "full_heldout_ppl_by_depth": final,
        "log": log,
    }
    (args.out / "training_log.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
