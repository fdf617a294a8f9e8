"""tinyloop-hf: Hugging Face drop-in models for looped (recurrent-depth) transformers.

Importing the package registers ``TinyLoopConfig`` / ``TinyLoopModel`` / ``TinyLoopForCausalLM`` with the Auto
classes, so ``AutoModelForCausalLM.from_pretrained(<tinyloop checkpoint>)`` works without ``trust_remote_code``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_tinyloop import TinyLoopCache
from .configuration_tinyloop import TinyLoopConfig
from .embedded import embedded_model_path
from .modeling_tinyloop import TinyLoopForCausalLM, TinyLoopModel
from .ops_tinyloop import get_op, register_op
from .paged_cache import PagedTinyLoopCache
from .quant_tinyloop import QuantEmbedding, QuantFormat, QuantLinear
from .quantizer_tinyloop import TinyLoopQuantConfig  # also registers the "tinyloop" quantizer with transformers

__version__ = "0.1.0"

AutoConfig.register(TinyLoopConfig.model_type, TinyLoopConfig, exist_ok=True)
AutoModel.register(TinyLoopConfig, TinyLoopModel, exist_ok=True)
AutoModelForCausalLM.register(TinyLoopConfig, TinyLoopForCausalLM, exist_ok=True)

__all__ = [
    "QuantEmbedding",
    "QuantFormat",
    "QuantLinear",
    "PagedTinyLoopCache",
    "TinyLoopCache",
    "TinyLoopConfig",
    "TinyLoopForCausalLM",
    "TinyLoopModel",
    "TinyLoopQuantConfig",
    "embedded_model_path",
    "get_op",
    "register_op",
]
