"""tinyloop-convert SRC DST: turn an Ouro / Huginn / Llama / Qwen2 / TinyLoop checkpoint into a TinyLoop
checkpoint, optionally quantized, and print a parity or quality report."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tinyloop_hf import TinyLoopForCausalLM, TinyLoopQuantConfig, embedded_model_path

from .core import DTYPES, convert_model, read_source, write_checkpoint
from .formats import FORMATS, ConversionError
from .parity import compare, reference_model
from .quantize import quantize_model
from .report import calibration_windows, format_table, text_windows
from .report import compare as compare_quality

COMPONENT_FLAGS = {
    "prelude": "prelude_bits",
    "loop": "loop_bits",
    "coda": "coda_bits",
    "lm_head": "head_bits",
    "embed_tokens": "embed_bits",
}
COMPONENT_HELP = {
    "prelude": "bits for the prelude layers (default: --bits)",
    "loop": "bits for the loop block and its input injection (default: --bits)",
    "coda": "bits for the coda layers (default: --bits)",
    "lm_head": "bits for the LM head (default: 16; 8 is per output channel)",
    "embed_tokens": "bits for the token embedding table (default: 16; 8 is per vocabulary row; a tied head keeps "
    "its own copy)",
}
BITS = [16, 8, 4, 3, 2]


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
    quant = parser.add_argument_group("quantization")
    quant.add_argument("--bits", type=int, choices=BITS, default=16, help="weight bits (16 = not quantized)")
    quant.add_argument(
        "--group-size",
        default="128",
        choices=["32", "64", "128", "channel"],
        help="columns per scale (channel = one scale per output row)",
    )
    quant.add_argument("--symmetric", action="store_true", help="fixed midpoint instead of a zero point per group")
    quant.add_argument("--scale-dtype", choices=["float16", "bfloat16"], default="float16")
    quant.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
    quant.add_argument(
        "--calib",
        help="text file for GPTQ calibration (default: the embedded model's calibration "
        "sample, 200 KB of public-domain text)",
    )
    quant.add_argument("--calib-samples", type=int, default=64, help="calibration windows")
    quant.add_argument("--calib-length", type=int, default=256, help="tokens per calibration window")
    for component, dest in COMPONENT_FLAGS.items():
        quant.add_argument(
            f"--{component.replace('_', '-')}-bits",
            dest=dest,
            type=int,
            choices=BITS,
            help=COMPONENT_HELP[component],
        )
    quant.add_argument(
        "--eval-text",
        help="held-out text for the quality report: perplexity, KL, top-1 per depth "
        "(default: the embedded model's held-out sample)",
    )
    quant.add_argument("--no-report", action="store_true", help="skip the quality report")
    quant.add_argument("--eval-windows", type=int, default=32, help="windows of held-out text to score")
    quant.add_argument("--report-depths", type=int, nargs="+", help="loop depths to report (default: 1 .. default)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where quantization and the report run"
    )
    parser.add_argument("--no-parity", action="store_true", help="skip the parity report")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail before any work (GPTQ may take long) on a text file that is not there or a count below 1."""
    for flag in ("calib", "eval_text"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            parser.error(f"--{flag.replace('_', '-')}: no such file: {path}")
    for flag in ("calib_samples", "calib_length", "eval_windows", "num_loops", "max_loops"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for depth in args.report_depths or []:
        if depth < 1:
            parser.error(f"--report-depths must be at least 1, got {depth}")


def quantization_config(args: argparse.Namespace) -> TinyLoopQuantConfig | None:
    """The requested quantization, or None when every component stays at 16 bits."""
    components = {
        component: {"bits": bits}
        for component, dest in COMPONENT_FLAGS.items()
        if (bits := getattr(args, dest)) is not None
    }
    for component in ("lm_head", "embed_tokens"):
        if components.get(component, {}).get("bits") == 8:
            components[component]["group_size"] = None  # INT8 tables are per row: nearly lossless, little overhead
    config = TinyLoopQuantConfig(
        bits=args.bits,
        group_size=None if args.group_size == "channel" else int(args.group_size),
        symmetric=args.symmetric,
        scale_dtype=args.scale_dtype,
        components=components,
        method=args.method,
    )
    return config if config.quantizes_anything() else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except (ConversionError, ValueError) as error:
        print(f"tinyloop-convert: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    quantization = quantization_config(args)
    source = read_source(args.src, args.gguf_file)
    model = convert_model(
        source, args.dtype, num_loops=args.num_loops, max_loops=args.max_loops, initial_state=args.initial_state
    )
    tokenizer = _text_settings(args, quantization) if quantization is not None else None
    reference = None
    if quantization is not None:
        if not args.no_parity:  # the conversion itself, before quantization changes the outputs
            _parity(model, source)
        calibration = None
        if quantization.method == "gptq":
            calibration = calibration_windows(
                tokenizer, Path(args.calib).read_text(), args.calib_samples, args.calib_length
            )
        reference = copy.deepcopy(model) if args.eval_text else None
        model = quantize_model(model.to(args.device), quantization, calibration).cpu()
    destination = write_checkpoint(model, args.dst, args.src, args.gguf_file)
    model = TinyLoopForCausalLM.from_pretrained(destination)
    _summary(model, destination, quantization)
    if reference is not None:
        windows = text_windows(
            tokenizer,
            Path(args.eval_text).read_text(),
            min(512, model.config.max_position_embeddings),
            args.eval_windows,
        )
        depths = args.report_depths or sorted(
            {1, 2, model.config.num_loops} & set(range(1, model.config.max_loops + 1))
        )
        rows = compare_quality(reference.to(args.device), model.to(args.device), windows, depths)
        print(
            format_table(rows, f"quality vs unquantized ({quantization.describe()}; {windows.numel()} held-out tokens)")
        )
    elif quantization is None and not args.no_parity:
        _parity(model, source)  # the written checkpoint, as loaded back
    return 0


def _text_settings(args: argparse.Namespace, quantization: TinyLoopQuantConfig):
    """Default the calibration and report texts to the embedded samples; return SRC's tokenizer (None when the
    report was only defaulted and SRC has no tokenizer: the report is then skipped, as said)."""
    samples = embedded_model_path()
    asked_for_text = quantization.method == "gptq" or args.eval_text is not None
    args.calib = args.calib or str(samples / "calibration_sample.txt")
    args.eval_text = None if args.no_report else args.eval_text or str(samples / "heldout_sample.txt")
    try:
        return AutoTokenizer.from_pretrained(args.src, gguf_file=args.gguf_file)
    except (OSError, ValueError) as error:
        if asked_for_text:
            raise ConversionError(f"GPTQ and --eval-text need a tokenizer in SRC: {error}") from None
        print("quality report skipped: SRC has no tokenizer to read held-out text with")
        args.eval_text = None
        return None


def _summary(model: TinyLoopForCausalLM, destination: Path, quantization: TinyLoopQuantConfig | None) -> None:
    config = model.config
    size = sum(path.stat().st_size for path in destination.glob("*.safetensors")) / 2**20
    print(
        f"wrote {destination}: {size:.1f} MiB of weights, prelude/loop/coda = {config.num_prelude_layers}/"
        f"{config.num_loop_layers}/{config.num_coda_layers}, num_loops {config.num_loops} (max {config.max_loops}), "
        f"dtype {config.dtype}"
        + (f", quantized: {quantization.describe()} ({quantization.method})" if quantization else "")
    )


def _parity(model: TinyLoopForCausalLM, source) -> None:
    reference = reference_model(source, model.dtype)
    if reference is None:
        print(
            "parity: no implementation of this format ships with transformers; the package's tests compare "
            "it with recorded reference outputs (tests/test_parity_reference.py)"
        )
    else:
        print(compare(model.eval(), reference).table())


if __name__ == "__main__":
    sys.exit(main())
