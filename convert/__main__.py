"""tinyloop-convert SRC DST: turn an Ouro / Huginn / Llama / Qwen2 checkpoint into a TinyLoop checkpoint."""

from __future__ import annotations

import argparse
import sys

from tinyloop_hf import TinyLoopForCausalLM

from .core import DTYPES, convert_checkpoint, read_source
from .formats import FORMATS, ConversionError
from .parity import compare, reference_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tinyloop-convert",
        description=f"Convert a checkpoint directory ({', '.join(sorted(FORMATS))}) into a TinyLoop checkpoint.",
    )
    parser.add_argument("src", help="source checkpoint directory (config.json + safetensors, or a GGUF file in it)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--gguf-file", help="read this GGUF file inside SRC (Llama/Qwen2; needs the gguf package)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="store weights in this dtype (default: as source)")
    parser.add_argument("--num-loops", type=int, help="default loop depth (default: the source's)")
    parser.add_argument("--max-loops", type=int, help="largest loop depth a call may ask for")
    parser.add_argument(
        "--initial-state",
        choices=["zeros", "random"],
        help="loop state before the first pass (models with input injection; default zeros)",
    )
    parser.add_argument("--no-parity", action="store_true", help="skip the parity report")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        destination = convert_checkpoint(
            args.src,
            args.dst,
            gguf_file=args.gguf_file,
            dtype=args.dtype,
            num_loops=args.num_loops,
            max_loops=args.max_loops,
            initial_state=args.initial_state,
        )
    except (ConversionError, ValueError) as error:
        print(f"tinyloop-convert: error: {error}", file=sys.stderr)
        return 2
    model = TinyLoopForCausalLM.from_pretrained(destination)
    config = model.config
    print(
        f"wrote {destination}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"prelude/loop/coda = {config.num_prelude_layers}/{config.num_loop_layers}/{config.num_coda_layers}, "
        f"num_loops {config.num_loops} (max {config.max_loops}), dtype {config.dtype}"
    )
    if not args.no_parity:
        reference = reference_model(read_source(args.src, args.gguf_file))
        if reference is None:
            print(
                "parity: no implementation of this format ships with transformers; the package's tests compare "
                "it with recorded reference outputs (tests/test_parity_reference.py)"
            )
        else:
            print(compare(model, reference).table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
