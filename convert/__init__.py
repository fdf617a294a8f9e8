"""Convert Ouro / Huginn / Llama / Qwen2 checkpoints into TinyLoop checkpoints (``tinyloop-convert SRC DST``)."""

from .core import build_model, check_state_dict, convert_checkpoint, read_source, source_from_model
from .formats import FORMATS, ConversionError
from .quantize import quantize_model

__all__ = [
    "FORMATS",
    "ConversionError",
    "build_model",
    "check_state_dict",
    "convert_checkpoint",
    "quantize_model",
    "read_source",
    "source_from_model",
]
