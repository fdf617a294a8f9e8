"""Source checkpoint formats: how each maps its config.json and tensor names onto TinyLoop.

Each format is a config mapping (source config dict -> TinyLoopConfig kwargs) and a tensor mapping (source state
dict -> TinyLoop state dict). Missing or mis-shaped source tensors are reported by ``convert.core``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]


class ConversionError(ValueError):
    """A source checkpoint that cannot be converted faithfully; the message names the field or tensor."""


def _get(config: dict[str, Any], key: str, format_name: str) -> Any:
    if key not in config:
        raise ConversionError(f"{format_name} config.json has no {key!r} field")
    return config[key]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConversionError(message)


def _token_ids(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _rope_theta(config: dict[str, Any], format_name: str) -> float:
    """rope_theta from a v4-style field or a v5 ``rope_parameters`` dict (neither: transformers' default, 10000);
    only plain (unscaled) RoPE converts."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = parameters.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    _require(rope_type == "default", f"{format_name}: rope type {rope_type!r} is not supported (only 'default')")
    theta = parameters.get("rope_theta", config.get("rope_theta"))
    return 10000.0 if theta is None else float(theta)  # LlamaConfig's and Qwen2Config's default, as transformers reads


def _rename_layers(tensors: Tensors, source_prefix: str, target_prefix: str) -> Tensors:
    pattern = re.compile(rf"^{re.escape(source_prefix)}\.(\d+)\.")
    return {pattern.sub(lambda m: f"{target_prefix}.{m.group(1)}.", name): value for name, value in tensors.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Llama / Qwen2 (plain decoders: the whole stack is the loop block, one loop)
# ----------------------------------------------------------------------------------------------------------------------


def llama_config(config: dict[str, Any]) -> dict[str, Any]:
    name = config.get("model_type", "llama")
    _require(not config.get("mlp_bias", False), f"{name}: mlp_bias=True is not supported")
    _require(config.get("hidden_act", "silu") == "silu", f"{name}: hidden_act must be 'silu'")
    if name == "qwen2":
        _require(not config.get("use_sliding_window", False), "qwen2: use_sliding_window=True is not supported")
        attention_bias = "qkv"
    else:
        _require(not config.get("attention_bias", False), "llama: attention_bias=True (o_proj bias) is not supported")
        attention_bias = "none"
    return {
        "vocab_size": _get(config, "vocab_size", name),
        "hidden_size": _get(config, "hidden_size", name),
        "intermediate_size": _get(config, "intermediate_size", name),
        "num_attention_heads": _get(config, "num_attention_heads", name),
        "num_key_value_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "num_loop_layers": _get(config, "num_hidden_layers", name),
        "num_loops": 1,
        "rope_theta": _rope_theta(config, name),
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": _get(config, "max_position_embeddings", name),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": attention_bias,
        **_token_ids(config),
    }


def llama_tensors(tensors: Tensors, config: dict[str, Any]) -> Tensors:
    renamed = _rename_layers(tensors, "model.layers", "model.loop_layers")
    if config.get("tie_word_embeddings"):
        renamed.pop("lm_head.weight", None)
    return renamed


# ----------------------------------------------------------------------------------------------------------------------
# Ouro (ByteDance): the whole stack loops total_ut_steps times, sandwich norms, final norm inside the loop, exit gate
# ----------------------------------------------------------------------------------------------------------------------


def ouro_config(config: dict[str, Any]) -> dict[str, Any]:
    _require(not config.get("use_sliding_window", False), "ouro: use_sliding_window=True is not supported")
    _require(not config.get("tie_word_embeddings", False), "ouro: tied embeddings are not part of the Ouro format")
    converted = llama_config({**config, "model_type": "ouro", "attention_bias": False})
    converted.update(
        num_loops=int(_get(config, "total_ut_steps", "ouro")),
        trained_loops=int(_get(config, "total_ut_steps", "ouro")),
        block_norm="sandwich",
        final_norm="every_loop",
        exit_gate=True,
        exit_threshold=config.get("early_exit_threshold"),
    )
    return converted


def ouro_tensors(tensors: Tensors, config: dict[str, Any]) -> Tensors:
    renamed = _rename_layers(tensors, "model.layers", "model.loop_layers")
    return {name.replace("model.early_exit_gate.", "model.exit_gate."): value for name, value in renamed.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Huginn-0125 (Raven): prelude / recurrent core with a linear adapter / coda, post-residual norms, interleaved RoPE
# ----------------------------------------------------------------------------------------------------------------------

_HUGINN_NORMS = {
    "norm_1": "input_layernorm",
    "norm_2": "input_layernorm_2",
    "norm_3": "post_attention_layernorm",
    "norm_4": "post_attention_layernorm_2",
}
_HUGINN_STAGES = {"prelude": "prelude_layers", "core_block": "loop_layers", "coda": "coda_layers"}


def huginn_config(config: dict[str, Any]) -> dict[str, Any]:
    name = "huginn_raven"
    _require(
        config.get("injection_type", "linear") == "linear",
        f"{name}: injection_type {config.get('injection_type')!r} is not supported (only 'linear')",
    )
    _require(not config.get("bias", False), f"{name}: bias=True is not supported")
    _require(not config.get("test_time_noise", 0), f"{name}: test_time_noise > 0 is not supported")
    hidden = _get(config, "n_embd", name)
    heads = _get(config, "n_heads", name)
    embed_scale = float((config.get("init_values") or {}).get("embed_scale", math.sqrt(hidden)))
    init_std = float((config.get("init_values") or {}).get("std", math.sqrt(2 / (5 * hidden))))
    return {
        "vocab_size": config.get("padded_vocab_size") or _get(config, "vocab_size", name),
        "hidden_size": hidden,
        "intermediate_size": _get(config, "intermediate_size", name),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": hidden // heads,
        "num_prelude_layers": _get(config, "n_layers_in_prelude", name),
        "num_loop_layers": _get(config, "n_layers_in_recurrent_block", name),
        "num_coda_layers": _get(config, "n_layers_in_coda", name),
        "num_loops": int(_get(config, "mean_recurrence", name)),
        "block_norm": "post_residual",
        "final_norm": "before_and_after_coda",
        "input_injection": "linear_concat",
        "initial_state": "zeros",  # the reference with init_scale=0: deterministic
        "initial_state_std": init_std * embed_scale,
        "attention_bias": "qk" if config.get("qk_bias", False) else "none",
        "rope_layout": "interleaved",
        "rope_theta": float(_get(config, "rope_base", name)),
        "rms_norm_eps": config.get("norm_eps", 1e-6),
        "max_position_embeddings": _get(config, "block_size", name),
        "embedding_scale": embed_scale,
        "tie_word_embeddings": bool(config.get("tie_embeddings", True)),
        **_token_ids(config),
    }


def huginn_tensors(tensors: Tensors, config: dict[str, Any]) -> Tensors:
    hidden, heads = config["n_embd"], config["n_heads"]
    head_dim, kv_heads = hidden // heads, config.get("num_key_value_heads") or heads
    converted: Tensors = {}
    for name, value in tensors.items():
        if name in ("freqs_cis", "transformer.freqs_cis"):
            continue  # recomputed from rope_theta; checked by convert.core
        if name == "lm_head.weight" and config.get("tie_embeddings", True):
            continue  # some uploads store the tied head twice
        match = re.match(r"^transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)$", name)
        if match is None:
            simple = {
                "transformer.wte.weight": "model.embed_tokens.weight",
                "transformer.adapter.weight": "model.injection.weight",
                "transformer.ln_f.weight": "model.norm.weight",
                "lm_head.weight": "lm_head.weight",
            }
            converted[simple.get(name, name)] = value
            continue
        stage, index, rest = match.groups()
        prefix = f"model.{_HUGINN_STAGES[stage]}.{index}."
        converted.update(
            {prefix + key: tensor for key, tensor in _huginn_block(rest, value, heads, kv_heads, head_dim).items()}
        )
    return converted


def _huginn_block(rest: str, value: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> Tensors:
    norm = rest.split(".")[0]
    if norm in _HUGINN_NORMS:
        return {f"{_HUGINN_NORMS[norm]}.weight": value}
    if rest == "attn.Wqkv.weight":  # rows: q | k | v
        q, k, v = value.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)
        return {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v}
    if rest == "attn.qk_bias":  # [2, 1, H, Dh], added to q and k before RoPE = a projection bias
        _require(
            value.shape[0] == 2 and value.shape[2] == heads,
            f"huginn_raven: attn.qk_bias must be [2, 1, {heads}, {head_dim}], got {list(value.shape)}",
        )
        return {"self_attn.q_proj.bias": value[0].reshape(-1), "self_attn.k_proj.bias": value[1].reshape(-1)}
    if rest == "attn.proj.weight":
        return {"self_attn.o_proj.weight": value}
    if rest == "mlp.fc.weight":  # rows: gate | up
        gate, up = value.chunk(2, dim=0)
        return {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up}
    if rest == "mlp.proj.weight":
        return {"mlp.down_proj.weight": value}
    return {rest: value}  # unknown: reported as unexpected by the checker


# ----------------------------------------------------------------------------------------------------------------------
# TinyLoop itself (re-conversion: quantize, change dtype or loop limits)
# ----------------------------------------------------------------------------------------------------------------------

_HF_BOOKKEEPING = (
    "model_type",
    "architectures",
    "auto_map",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "num_hidden_layers",
    "_name_or_path",
)


def tinyloop_config(config: dict[str, Any]) -> dict[str, Any]:
    _require(
        "quantization_config" not in config,
        "tinyloop: the source is already quantized; convert from the unquantized checkpoint",
    )
    return {key: value for key, value in config.items() if key not in _HF_BOOKKEEPING}


def tinyloop_tensors(tensors: Tensors, config: dict[str, Any]) -> Tensors:
    return dict(tensors)


# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceFormat:
    name: str
    config: Callable[[dict[str, Any]], dict[str, Any]]
    tensors: Callable[[Tensors, dict[str, Any]], Tensors]
    has_reference_in_transformers: bool


FORMATS: dict[str, SourceFormat] = {
    "llama": SourceFormat("llama", llama_config, llama_tensors, True),
    "qwen2": SourceFormat("qwen2", llama_config, llama_tensors, True),
    "ouro": SourceFormat("ouro", ouro_config, ouro_tensors, False),
    "huginn_raven": SourceFormat("huginn_raven", huginn_config, huginn_tensors, False),
    "tinyloop": SourceFormat("tinyloop", tinyloop_config, tinyloop_tensors, False),
}


def source_format(config: dict[str, Any]) -> SourceFormat:
    model_type = config.get("model_type")
    if model_type not in FORMATS:
        raise ConversionError(
            f"unknown architecture: config.json model_type={model_type!r}; supported: {sorted(FORMATS)}"
        )
    return FORMATS[model_type]
