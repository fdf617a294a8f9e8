"""Read an Ouro / Huginn / Llama / Qwen2 checkpoint, map it onto TinyLoop, check every tensor, write or build."""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import GenerationConfig

from tinyloop_hf import TinyLoopConfig, TinyLoopForCausalLM, TinyLoopQuantConfig
from tinyloop_hf.configuration_tinyloop import is_int
from tinyloop_hf.ops_tinyloop import rope_angles

from .formats import ConversionError, SourceFormat, Tensors, source_format
from .quantize import quantize_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Source:
    """A checkpoint as read from disk (or from a GGUF file through transformers)."""

    config: dict[str, Any]
    tensors: Tensors
    format: SourceFormat
    directory: Path
    gguf_file: str | None = None
    generation: dict[str, Any] | None = None


def read_source(src: str | Path, gguf_file: str | None = None) -> Source:
    directory = Path(src)
    if not directory.is_dir():
        raise ConversionError(f"source {str(directory)!r} is not a directory")
    if gguf_file is not None:
        return _read_gguf(directory, gguf_file)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ConversionError(f"source {str(directory)!r} has no config.json")
    config = json.loads(config_path.read_text())
    generation_path = directory / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else None
    return Source(config, _read_safetensors(directory), source_format(config), directory, None, generation)


def _read_safetensors(directory: Path) -> Tensors:
    files = sorted(directory.glob("*.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
    files = [file for file in files if file.name != "reference.safetensors"]
    if not files:
        raise ConversionError(f"source {str(directory)!r} has no *.safetensors weights")
    tensors: Tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def _read_gguf(directory: Path, gguf_file: str) -> Source:
    """GGUF files are dequantized by transformers (needs the gguf package) into a Llama/Qwen2 state dict."""
    from transformers import AutoModelForCausalLM

    if not (directory / gguf_file).is_file():
        raise ConversionError(f"--gguf-file {gguf_file!r}: no such file in {str(directory)!r}")
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    source = source_from_model(model)
    source.directory, source.gguf_file = directory, gguf_file
    return source


def source_from_model(model: Any) -> Source:
    """A Llama / Qwen2 model already loaded by transformers (e.g. from a GGUF file) as a conversion source."""
    config = model.config.to_dict()
    generation = model.generation_config.to_dict() if model.generation_config is not None else None
    directory = Path(getattr(model.config, "_name_or_path", "") or ".")
    return Source(config, dict(model.state_dict()), source_format(config), directory, None, generation)


def tinyloop_config(source: Source, **overrides: Any) -> TinyLoopConfig:
    fields = set(inspect.signature(TinyLoopConfig.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConversionError(f"unknown TinyLoopConfig fields {unknown}; allowed: {sorted(fields)}")
    kwargs = source.format.config(source.config)
    kwargs.update({key: value for key, value in overrides.items() if value is not None})
    return TinyLoopConfig(**kwargs)


def convert_tensors(source: Source, config: TinyLoopConfig, dtype: torch.dtype | None = None) -> Tensors:
    """Map source tensors onto TinyLoop names and check the result against the model's own parameters."""
    if source.format.name == "huginn_raven":
        _check_huginn_rope(source, config)
    tensors = source.format.tensors(source.tensors, source.config)
    check_state_dict(tensors, config)
    if dtype is not None:
        tensors = {name: value.to(dtype) for name, value in tensors.items()}
    # Fresh contiguous storage: split views of one fused source tensor must not alias each other on disk.
    return {name: value.contiguous().clone() for name, value in tensors.items()}


def check_state_dict(tensors: Tensors, config: TinyLoopConfig) -> None:
    """Raise a ConversionError naming every missing, unexpected or mis-shaped tensor."""
    with torch.device("meta"):
        expected = {name: tuple(value.shape) for name, value in TinyLoopForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [
        f"{name}: expected {list(expected[name])}, got {list(tensors[name].shape)}"
        for name in sorted(set(expected) & set(tensors))
        if tuple(tensors[name].shape) != expected[name]
    ]
    problems = (
        [f"missing tensors {missing}"] * bool(missing)
        + [f"unexpected tensors {unexpected}"] * bool(unexpected)
        + [f"shape mismatch: {'; '.join(wrong_shape)}"] * bool(wrong_shape)
    )
    if problems:
        raise ConversionError("source weights do not fit the converted config: " + " | ".join(problems))


def _check_huginn_rope(source: Source, config: TinyLoopConfig) -> None:
    stored = source.tensors.get("freqs_cis")
    if stored is None:
        return
    positions = torch.arange(stored.shape[1])[None]
    cos, sin = rope_angles(positions, config.head_dim, config.rope_theta)
    ours = torch.stack((cos, sin), dim=-1)[:, :, None]  # [1, T, 1, Dh/2, 2], the reference's layout
    # atol 1e-3: a wrong base or head_dim is off by far more within a few positions, while the table's own maths may
    # differ a little from ours (another device or math library; MKL's first-call race, see tinyloop_hf/mkl_warmup.py,
    # made examples/loop_depth.py fail this check at 1e-5 in ~1 run of 10 before the warm-up).
    if ours.shape != stored.shape or not torch.allclose(ours, stored.float(), atol=1e-3):
        raise ConversionError("freqs_cis stored in the Huginn checkpoint does not match rope_base / head_dim")


def build_model(source: Source, dtype: torch.dtype | None = None, **overrides: Any) -> TinyLoopForCausalLM:
    """Convert in memory: a TinyLoopForCausalLM holding the source weights."""
    config = tinyloop_config(source, **overrides)
    tensors = convert_tensors(source, config, dtype)
    config.dtype = next(iter(tensors.values())).dtype
    with torch.device("meta"):
        model = TinyLoopForCausalLM(config)
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = generation_config(source, config, depth_given=overrides.get("num_loops") is not None)
    return model.eval()


HUGINN_STOP_IDS = (65504, 65505, 65508)
# Loop depths a generation config may hold: (field, lowest value, offset from max_loops of the highest).
_DEPTH_FIELDS = (("num_loops", 1, 0), ("draft_loops", 1, 0), ("warmup_loops", 1, 0), ("exit_at_step", 0, -1))


def generation_config(source: Source, config: TinyLoopConfig, depth_given: bool = False) -> GenerationConfig:
    """The source's generation settings (token ids filled from the config), saved with custom fields kept. A depth
    given to the conversion (num_loops) replaces the source generation config's; its depths must fit max_loops."""
    values = {
        key: value
        for key, value in (source.generation or {}).items()
        if not key.startswith("_") and key != "transformers_version"
    }
    if depth_given:
        values.pop("num_loops", None)
    for field, lowest, offset in _DEPTH_FIELDS:
        value = values.get(field)
        depths = value if isinstance(value, list) else [value]
        if value is not None and not all(is_int(d) and lowest <= d <= config.max_loops + offset for d in depths):
            raise ConversionError(
                f"the source's generation_config.{field}={value!r} does not fit the converted model: it must be in "
                f"[{lowest}, {config.max_loops + offset}] (max_loops={config.max_loops}); pass a larger --max-loops"
            )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if values.get(key) is None and getattr(config, key) is not None:
            values[key] = getattr(config, key)
    if source.format.name == "huginn_raven" and config.vocab_size > max(HUGINN_STOP_IDS):
        # Huginn's own generate() always stops on these (begin / end of text, end of turn), whatever the config says.
        eos = values.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        values["eos_token_id"] = eos + [token for token in HUGINN_STOP_IDS if token not in eos]
    generation = GenerationConfig(**values)
    generation._from_model_config = False
    return generation


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    gguf_file: str | None = None,
    dtype: str | None = None,
    quantization: TinyLoopQuantConfig | None = None,
    calibration: torch.Tensor | None = None,
    device: str = "cpu",
    progress: bool = True,
    **overrides: Any,
) -> Path:
    """Convert SRC (Ouro / Huginn / Llama / Qwen2 / TinyLoop directory, or a GGUF file in it) into DST.

    ``overrides`` set TinyLoopConfig fields (e.g. ``max_loops=32``, ``initial_state="random"``);
    ``quantization`` packs the weights (GPTQ needs ``calibration`` token ids [n, T]).
    """
    model = convert_model(read_source(src, gguf_file), dtype=dtype, **overrides)
    if quantization is not None:
        model = quantize_model(model.to(device), quantization, calibration, progress=progress).cpu()
    return write_checkpoint(model, dst, src, gguf_file)


def write_checkpoint(model: TinyLoopForCausalLM, dst: str | Path, src: str | Path, gguf_file: str | None) -> Path:
    """save_pretrained (weights, config with auto_map, generation config, shims) plus the source's tokenizer."""
    destination = Path(dst)
    model.config.architectures = ["TinyLoopForCausalLM"]
    model.save_pretrained(destination)
    _copy_tokenizer(Path(src), gguf_file, destination)
    return destination


def convert_model(source: Source, dtype: str | None = None, **overrides: Any) -> TinyLoopForCausalLM:
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return build_model(source, DTYPES.get(dtype) if dtype else None, **overrides)


def _copy_tokenizer(directory: Path, gguf_file: str | None, destination: Path) -> None:
    """SRC's tokenizer files into DST, replacing any an earlier conversion into DST left there (a stale tokenizer next
    to other weights would load without complaint). Nothing to do when SRC is DST."""
    if directory.resolve() == destination.resolve():
        return
    stale = [name for name in TOKENIZER_FILES if (destination / name).exists()]
    for name in stale:
        (destination / name).unlink()
    if stale:
        print(f"replaced the tokenizer files an earlier conversion left in {destination}: {', '.join(stale)}")
    if gguf_file is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file).save_pretrained(destination)
        return
    for name in TOKENIZER_FILES:
        if (directory / name).exists():
            shutil.copy2(directory / name, destination / name)
