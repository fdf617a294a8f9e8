"""``quantization_config`` for TinyLoop checkpoints and its transformers quantizer.

config.json carries ``{"quant_method": "tinyloop", "bits": 4, "group_size": 128, "symmetric": false,
"scale_dtype": "float16", "components": {"lm_head": {"bits": 8, "group_size": null}}}``. Components are the
places a linear can live: ``prelude``, ``loop`` (the loop block and its input injection), ``coda`` and
``lm_head``, plus the token embedding table ``embed_tokens``. Each takes the top-level format unless
``components`` overrides it; bits 16 keeps it in high precision. The LM head and the embedding stay high precision
unless asked; norms and the exit gate always do. A quantized embedding of a tied model unties it: the head keeps its
own copy of the table (high precision, or quantized as ``lm_head`` says).
Loading registers nothing at run time beyond this module: ``import tinyloop_hf`` makes transformers build the
packed modules before the weights are read.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from .configuration_tinyloop import is_int
from .quant_tinyloop import SUPPORTED_BITS, PackedModule, QuantEmbedding, QuantFormat, QuantLinear

QUANT_METHOD = "tinyloop"
COMPONENTS = ("prelude", "loop", "coda", "lm_head", "embed_tokens")
HIGH_PRECISION_UNLESS_ASKED = ("lm_head", "embed_tokens")
FULL_PRECISION = 16
# Module names in TinyLoopForCausalLM ("model." first) or in the base TinyLoopModel (AutoModel: no prefix).
_COMPONENT_OF = (
    (re.compile(r"^(model\.)?prelude_layers\."), "prelude"),
    (re.compile(r"^(model\.)?(loop_layers\.|injection$)"), "loop"),
    (re.compile(r"^(model\.)?coda_layers\."), "coda"),
    (re.compile(r"^lm_head$"), "lm_head"),
    (re.compile(r"^(model\.)?embed_tokens$"), "embed_tokens"),
)
_FORMAT_KEYS = ("bits", "group_size", "symmetric", "scale_dtype")


def component_of(module_name: str) -> str | None:
    """Which component a linear or the embedding belongs to (None: never quantized, e.g. the exit gate)."""
    for pattern, component in _COMPONENT_OF:
        if pattern.search(module_name):
            return component
    return None


class TinyLoopQuantConfig(QuantizationConfigMixin):
    def __init__(
        self,
        bits: int = 4,
        group_size: int | None = 128,
        symmetric: bool = False,
        scale_dtype: str = "float16",
        components: dict[str, dict[str, Any]] | None = None,
        method: str = "rtn",
        **kwargs: Any,
    ) -> None:
        self.quant_method = QUANT_METHOD
        self.bits, self.group_size, self.symmetric, self.scale_dtype = bits, group_size, symmetric, scale_dtype
        for name, value in (components or {}).items():
            if not isinstance(value, dict):
                raise ValueError(f"quantization_config.components.{name} must be a dict of format fields (bits, "
                                 f"group_size, symmetric, scale_dtype), got {value!r}")  # fmt: skip
        self.components = {name: dict(value) for name, value in (components or {}).items()}
        self.method = method
        unknown = set(kwargs) - {"quant_method"}
        if unknown:
            raise ValueError(f"quantization_config has unknown fields {sorted(unknown)}")
        self.validate()

    def validate(self) -> None:
        if not _is_bits(self.bits):
            raise ValueError(
                f"quantization_config.bits must be one of {[*SUPPORTED_BITS, FULL_PRECISION]}, got {self.bits!r}"
            )
        # The top-level group size and scale dtype first, so that an error raised for a component below comes from
        # its own override (and says so).
        QuantFormat(SUPPORTED_BITS[-1], self.group_size, self.symmetric, self.scale_dtype)
        unknown = set(self.components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"quantization_config.components: unknown {sorted(unknown)}; allowed {list(COMPONENTS)}")
        for component in COMPONENTS:
            settings = self._settings(component)
            bad = set(settings) - set(_FORMAT_KEYS)
            if bad:
                raise ValueError(f"quantization_config.components.{component}: unknown fields {sorted(bad)}")
            if not _is_bits(settings["bits"]):
                raise ValueError(
                    f"quantization_config.components.{component}.bits must be one of "
                    f"{[*SUPPORTED_BITS, FULL_PRECISION]}, got {settings['bits']!r}"
                )
            try:
                self.format_for_component(component)  # validates group size and scale dtype
            except ValueError as error:
                raise ValueError(f"quantization_config.components.{component}: {error}") from None
        if self.method not in ("rtn", "gptq"):
            raise ValueError(f"quantization_config.method must be 'rtn' or 'gptq', got {self.method!r}")

    def _settings(self, component: str) -> dict[str, Any]:
        defaults = {
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "scale_dtype": self.scale_dtype,
        }
        if component in HIGH_PRECISION_UNLESS_ASKED:
            defaults["bits"] = FULL_PRECISION
        return {**defaults, **self.components.get(component, {})}

    def format_for_component(self, component: str | None) -> QuantFormat | None:
        if component is None:
            return None
        settings = self._settings(component)
        if settings["bits"] == FULL_PRECISION:
            return None
        return QuantFormat(**settings)

    def quantizes_anything(self) -> bool:
        return any(self.format_for_component(component) is not None for component in COMPONENTS)

    def format_for(self, module_name: str) -> QuantFormat | None:
        return self.format_for_component(component_of(module_name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD,
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "scale_dtype": self.scale_dtype,
            "components": self.components,
            "method": self.method,
        }

    def describe(self) -> str:
        parts = []
        for component in COMPONENTS:
            fmt = self.format_for_component(component)
            if fmt is None:
                parts.append(f"{component}=16")
            else:
                group = "channel" if fmt.group_size is None else f"g{fmt.group_size}"
                parts.append(f"{component}={fmt.bits}/{group}/{'sym' if fmt.symmetric else 'asym'}")
        return ", ".join(parts)


def swap_in_quantized(model: nn.Module, name: str, module: nn.Module, fmt: QuantFormat) -> PackedModule:
    """Put an empty QuantLinear (for an nn.Linear) or QuantEmbedding (for an nn.Embedding) of ``fmt`` where
    ``name`` was (in place) and return it. The embedding's output dtype is the replaced table's."""
    if isinstance(module, nn.Embedding):
        quantized = QuantEmbedding(module.num_embeddings, module.embedding_dim, fmt, name, module.weight.dtype)
    else:
        quantized = QuantLinear(module.in_features, module.out_features, module.bias is not None, fmt, name)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, quantized)
    return quantized


def quantization_targets(model: nn.Module, config: TinyLoopQuantConfig) -> dict[str, nn.Module]:
    """The linears and the token embedding that ``config`` quantizes, by name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Embedding)) and config.format_for(name) is not None
    }


def check_targets(model: nn.Module, config: TinyLoopQuantConfig) -> None:
    """Every target's row length fits its format (packing needs a multiple of 32); the error names the module."""
    for name, module in quantization_targets(model, config).items():
        if isinstance(module, nn.Embedding):
            config.format_for(name).check_shape(module.embedding_dim, name, "embedding_dim")
        else:
            config.format_for(name).check_shape(module.in_features, name, "in_features")


def tied_components(model: nn.Module, config: TinyLoopQuantConfig) -> list[str]:
    """Quantized components that share a tensor with another one (tie_word_embeddings: lm_head and embed_tokens)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    return [component for component in ("embed_tokens", "lm_head") if config.format_for_component(component)]


def replace_linears(model: nn.Module, config: TinyLoopQuantConfig) -> dict[str, PackedModule]:
    """Swap every quantized linear, and the token embedding when quantized, for an empty QuantLinear /
    QuantEmbedding of its component's format (in place)."""
    return {
        name: swap_in_quantized(model, name, module, config.format_for(name))
        for name, module in quantization_targets(model, config).items()
    }


class TinyLoopHfQuantizer(HfQuantizer):
    """Pre-quantized checkpoints only: modules are swapped on the meta model, packed tensors load as they are."""

    requires_calibration = True

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        # Loading ties lm_head.weight to model.embed_tokens.weight when the config says so; a quantized side has no
        # such tensor, which is why quantize_model saves quantized checkpoints untied.
        tied = tied_components(model, self.quantization_config)
        if tied:
            raise ValueError(
                f"quantizing {' and '.join(tied)} needs tie_word_embeddings=False (each side keeps its own weights; "
                f"tinyloop_hf.convert.quantize_model unties the model it quantizes)"
            )
        replace_linears(model, self.quantization_config)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
    register_quantization_config(QUANT_METHOD)(TinyLoopQuantConfig)
if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantizer(QUANT_METHOD)(TinyLoopHfQuantizer)


def _is_bits(value: Any) -> bool:
    """Weight bits, or FULL_PRECISION (not quantized); an int, not 4.0 or True."""
    return is_int(value) and value in (*SUPPORTED_BITS, FULL_PRECISION)
