"""What differs between the transformers 5.x releases we support (5.17 to the newest 5.x), detected once."""

from __future__ import annotations

import dataclasses
import inspect

from transformers import GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast


def _cache_field(output_class: type) -> str:
    return "cache" if "cache" in {field.name for field in dataclasses.fields(output_class)} else "past_key_values"


# 5.24 renamed the cache everywhere: the output field generate() reads back, and the kwarg it passes to forward().
CACHE_OUTPUT_FIELD = _cache_field(CausalLMOutputWithPast)
GENERATE_CACHE_KEY = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)

# ... and the cache field of generate()'s output classes.
GENERATE_OUTPUT_CACHE_FIELD = _cache_field(GenerateDecoderOnlyOutput)


def graph_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (always False on CPU-only builds)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
