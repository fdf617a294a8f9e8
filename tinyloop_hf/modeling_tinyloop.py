"""TinyLoopModel / TinyLoopForCausalLM: embed -> prelude -> num_loops x (injection + loop block) -> coda -> head.

Every numeric op goes through ``ops_tinyloop.get_op(name, module.op_backend)``, so a quantized linear or the CUDA
kernels replace the reference without touching this file. Modules call linear / rms_norm and block-level ops
(self_attention, mlp, residual_norm, junction_attention, junction_mlp) whose reference versions below are built from
the small reference ops (rope, attention, swiglu, rms_norm); a backend may fuse them (the CUDA one does). Architectures
differ only in ``TinyLoopConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .cache_tinyloop import TinyLoopCache
from .compat import CACHE_OUTPUT_FIELD, graph_capturing
from .configuration_tinyloop import TinyLoopConfig, is_int, is_probability
from .generation_tinyloop import TinyLoopGenerationMixin
from .loop_exit import EarlyExit, exit_distribution, select_states, threshold_exit_steps
from .offload import hook_offloaded_blocks
from .ops_tinyloop import REFERENCE, Junction, get_op, register_op, rope_angles
from .quant_tinyloop import PackedModule, packed_shape_errors

logger = logging.get_logger(__name__)
LoopCount = int | Sequence[int] | torch.Tensor


@dataclass
class TinyLoopModelOutput(BaseModelOutputWithPast):
    """``hidden_states``: (loop input, state after loop 1, ..., state after loop T) when requested.
    ``exit_probabilities`` [B, S, T] and ``gate_logits`` [B, S, T]: the exit gate's distribution over loops.
    ``loops_run`` [B]: loops each row computed in this call (with early_exit; otherwise None)."""

    exit_probabilities: torch.Tensor | None = None
    gate_logits: torch.Tensor | None = None
    loops_run: torch.Tensor | None = None


@dataclass
class TinyLoopCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus the exit gate's distribution over loops ([B, S, T] each) and, with early_exit,
    the loops each row computed ([B])."""

    exit_probabilities: torch.Tensor | None = None
    gate_logits: torch.Tensor | None = None
    loops_run: torch.Tensor | None = None


@dataclass
class _ForwardContext:
    """What every layer of one forward shares: RoPE angles, the attention mask, the cache."""

    cos: torch.Tensor  # [B, S, Dh/2] fp32
    sin: torch.Tensor
    mask: torch.Tensor | None  # bool [B or 1, 1, S, past + S], True = may attend
    is_causal: bool
    cache: TinyLoopCache | None
    past_length: int
    rows: torch.Tensor | None = None  # the batch rows this context serves (None: all of them)
    batch: int = 0  # rows in the whole batch

    def select(self, rows: torch.Tensor) -> _ForwardContext:
        """The context of a subset of the batch's rows (rows that are still looping)."""
        mask = self.mask if self.mask is None or self.mask.shape[0] == 1 else self.mask[rows]
        return replace(self, cos=self.cos[rows], sin=self.sin[rows], mask=mask, rows=rows, batch=self.cos.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> _ForwardContext:
        """The context with its tensors on ``device`` and the same cache (accelerate's hooks call this when a device
        map puts a block on another GPU than the one before it)."""
        device = torch.device(device)
        if self.cos.device == device:
            return self

        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device, non_blocking=non_blocking)

        return replace(self, cos=moved(self.cos), sin=moved(self.sin), mask=moved(self.mask), rows=moved(self.rows))


# ----------------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------------


class TinyLoopRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.op_backend = REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("rms_norm", self.op_backend)(x, self.weight, self.eps)


class TinyLoopLinear(nn.Linear):
    """nn.Linear whose matmul goes through the op layer (QuantLinear replaces it as a whole module)."""

    op_backend = REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("linear", self.op_backend)(x, self.weight, self.bias)


class TinyLoopAttention(nn.Module):
    def __init__(self, config: TinyLoopConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.scaling = config.head_dim**-0.5
        qk_bias = config.attention_bias in ("qk", "qkv")
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = TinyLoopLinear(hidden, heads * self.head_dim, bias=qk_bias)
        self.k_proj = TinyLoopLinear(hidden, kv_heads * self.head_dim, bias=qk_bias)
        self.v_proj = TinyLoopLinear(hidden, kv_heads * self.head_dim, bias=config.attention_bias == "qkv")
        self.o_proj = TinyLoopLinear(heads * self.head_dim, hidden, bias=False)
        self.op_backend = REFERENCE

    def forward(self, x: torch.Tensor, context: _ForwardContext, slot: int) -> torch.Tensor:
        return get_op("self_attention", self.op_backend)(self, x, context, slot)


@register_op("self_attention", REFERENCE)
def reference_self_attention(
    module: TinyLoopAttention, x: torch.Tensor, context: _ForwardContext, slot: int
) -> torch.Tensor:
    """Projections, RoPE, cache append and attention through the small ops (a backend may fuse all of it)."""
    batch, length, _ = x.shape
    shape = (batch, length, -1, module.head_dim)
    query = module.q_proj(x).view(shape).transpose(1, 2)  # [B, Hq, S, Dh]
    key = module.k_proj(x).view(shape).transpose(1, 2)  # [B, Hkv, S, Dh]
    value = module.v_proj(x).view(shape).transpose(1, 2)
    rope = get_op("rope", REFERENCE)
    query = rope(query, context.cos, context.sin, module.config.rope_layout)
    key = rope(key, context.cos, context.sin, module.config.rope_layout)
    if context.cache is not None:
        key, value = context.cache.update(
            key, value, slot, past_length=context.past_length, rows=context.rows, batch=context.batch
        )
    implementation = "eager" if module.config._attn_implementation == "eager" else "sdpa"
    out = get_op("attention", REFERENCE)(
        query, key, value, context.mask, context.is_causal, module.scaling, implementation
    )  # [B, Hq, S, Dh]
    return module.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class TinyLoopMLP(nn.Module):
    def __init__(self, config: TinyLoopConfig) -> None:
        super().__init__()
        self.gate_proj = TinyLoopLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = TinyLoopLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = TinyLoopLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.op_backend = REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("mlp", self.op_backend)(self, x)


@register_op("mlp", REFERENCE)
def reference_mlp(module: TinyLoopMLP, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(get_op("swiglu", REFERENCE)(module.gate_proj(x), module.up_proj(x)))


@dataclass
class DeferredJunction:
    """A block's last residual junction, left for the next block to run: the sublayer output and its norm weight."""

    branch: torch.Tensor
    branch_weight: torch.Tensor | None


class TinyLoopBlock(nn.Module):
    """Attention + SwiGLU MLP with the configured norm placement (N1..N4 are Ouro's names)."""

    gradient_checkpointing = False  # set by gradient_checkpointing_enable(), with _gradient_checkpointing_func

    def __init__(self, config: TinyLoopConfig) -> None:
        super().__init__()
        self.block_norm = config.block_norm
        self.op_backend = REFERENCE
        self.self_attn = TinyLoopAttention(config)
        self.mlp = TinyLoopMLP(config)
        self.input_layernorm = TinyLoopRMSNorm(config.hidden_size, config.rms_norm_eps)  # N1
        self.post_attention_layernorm = TinyLoopRMSNorm(config.hidden_size, config.rms_norm_eps)  # N3
        if config.block_norm != "pre":
            self.input_layernorm_2 = TinyLoopRMSNorm(config.hidden_size, config.rms_norm_eps)  # N2
            self.post_attention_layernorm_2 = TinyLoopRMSNorm(config.hidden_size, config.rms_norm_eps)  # N4

    def forward(
        self,
        x: torch.Tensor,
        context: _ForwardContext,
        slot: int,
        deferred: DeferredJunction | None = None,
        defer: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, DeferredJunction]:
        """x -> the block's output. Chained blocks (``TinyLoopModel._run_layers``) defer the last junction: with
        ``defer`` the block returns its residual stream before that junction and the junction's branch, and the
        next block, given them as (x, ``deferred``), runs that junction together with its own input norm and
        attention (one op, which the CUDA path fuses into the QKV projection)."""
        eps, mode = self.input_layernorm.eps, self.block_norm
        if deferred is None:
            attn = self.self_attn(self.input_layernorm(x), context, slot)
        else:
            junction = Junction(x, deferred.branch, deferred.branch_weight, self.input_layernorm.weight, eps, mode)
            x, attn = get_op("junction_attention", self.op_backend)(self.self_attn, junction, context, slot)
        branch_norm = getattr(self, "input_layernorm_2", None)
        branch_weight = branch_norm.weight if branch_norm is not None else None
        junction = Junction(x, attn, branch_weight, self.post_attention_layernorm.weight, eps, mode)
        x, mlp = get_op("junction_mlp", self.op_backend)(self.mlp, junction)
        last_norm = getattr(self, "post_attention_layernorm_2", None)
        if defer:
            return x, DeferredJunction(mlp, last_norm.weight if last_norm is not None else None)
        x, _ = self._junction(x, mlp, last_norm, None)
        return x

    def _junction(
        self, x: torch.Tensor, branch: torch.Tensor, branch_norm: nn.Module | None, next_norm: nn.Module | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Residual update after a sublayer and the next sublayer's input norm, as one op."""
        return get_op("residual_norm", self.op_backend)(
            x,
            branch,
            branch_norm.weight if branch_norm is not None else None,
            next_norm.weight if next_norm is not None else None,
            self.input_layernorm.eps,
            self.block_norm,
        )


@register_op("residual_norm", REFERENCE)
def reference_residual_norm(
    x: torch.Tensor,
    branch: torch.Tensor,
    branch_weight: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    eps: float,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(new residual stream, next sublayer's normed input or None). Modes: "pre" x + b (Llama), "sandwich"
    x + norm(b) (Ouro), "post_residual" norm(b + x) (Huginn)."""
    norm = get_op("rms_norm", REFERENCE)
    if mode == "pre":
        total = x + branch
    elif mode == "sandwich":
        total = x + norm(branch, branch_weight, eps)
    else:
        total = norm(branch + x, branch_weight, eps)
    return total, norm(total, next_weight, eps) if next_weight is not None else None


@register_op("junction_attention", REFERENCE)
def reference_junction_attention(
    module: TinyLoopAttention, junction: Junction, context: _ForwardContext, slot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous block's last junction and attention on its normed output, as one op so that a backend may fuse
    the junction into the QKV projection: (new residual stream, attention output)."""
    total, normed = get_op("residual_norm", REFERENCE)(*junction.residual_norm_args())
    return total, module(normed, context, slot)


@register_op("junction_mlp", REFERENCE)
def reference_junction_mlp(module: TinyLoopMLP, junction: Junction) -> tuple[torch.Tensor, torch.Tensor]:
    """The junction after attention and the MLP on its normed output, as one op so that a backend may fuse the
    junction into the MLP's first projection: (new residual stream, MLP output)."""
    total, normed = get_op("residual_norm", REFERENCE)(*junction.residual_norm_args())
    return total, module(normed)


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------


class TinyLoopPreTrainedModel(PreTrainedModel):
    config_class = TinyLoopConfig
    config: TinyLoopConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["TinyLoopBlock"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True  # per block (TinyLoopModel._run_layers), every loop's applications too
    _can_compile_fullgraph = False
    # Checkpoint tensors this class may leave unused (the base model loaded from a causal-LM checkpoint).
    _unused_checkpoint_prefixes: tuple[str, ...] = ()

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoModel") -> None:
        """No-op: checkpoints carry small import shims (``remote_code.py``), never copies of this package's code."""

    def set_op_backend(self, backend: str) -> None:
        """Route every op of every module through ``backend`` ("reference", or "cuda" via ``use_cuda_path``)."""
        for module in self.modules():
            if hasattr(module, "op_backend"):
                module.op_backend = backend

    def new_cache(self, capacity: int | None = None) -> TinyLoopCache:
        """An empty cache for this model: a TinyLoopCache on the reference path, the paged cache on the CUDA path
        (``capacity``: tokens per row to reserve; it grows when exceeded)."""
        if capacity is not None and (not is_int(capacity) or capacity < 1):
            raise ValueError(f"capacity must be None or a positive integer (tokens per row), got {capacity!r}")
        path = getattr(self, "_cuda_path", None)
        return path.new_cache(capacity) if path is not None else TinyLoopCache(self.config)

    def use_cuda_path(self, kv_cache_dtype: str = "auto", cuda_graphs: bool = True, run_ahead: bool = True) -> Any:
        """Run every op on the CUDA kernels (``kernels/``): low-bit GEMV, fused norms, paged attention with
        ``kv_cache_dtype`` "auto" (model dtype) or "int8", and (``cuda_graphs``) decode steps replayed from CUDA
        graphs inside ``generate()``; with ``run_ahead``, greedy generate() replays each next step on a side stream
        while transformers does its per-token host work (same outputs; see ``cuda_path``). Needs CuPy, an sm_80+
        GPU and a float16/bfloat16 model; raises otherwise."""
        from .cuda_path import CudaPath

        for name, value in (("cuda_graphs", cuda_graphs), ("run_ahead", run_ahead)):
            if not isinstance(value, bool):  # "false" is truthy: it would turn the feature on
                raise ValueError(f"use_cuda_path({name}=...) must be True or False, got {value!r}")
        self._share_cuda_path(CudaPath(self, kv_cache_dtype, cuda_graphs, run_ahead))
        self.set_op_backend("cuda")
        return self

    def release_cuda_caches(self) -> None:
        """Drop the K/V storages and CUDA graphs the CUDA path keeps for later generate() calls of the same shapes;
        their memory returns to PyTorch's allocator (``torch.cuda.empty_cache()`` hands it to the driver). The path
        also drops the least recently used ones by itself when a new shape would not fit beside them."""
        path = getattr(self, "_cuda_path", None)
        if path is not None:
            path.release()

    def use_reference_path(self) -> Any:
        """Back to the pure-PyTorch reference ops (and unpaged caches)."""
        self.set_op_backend(REFERENCE)
        self._share_cuda_path(None)
        return self

    def _share_cuda_path(self, path: Any) -> None:
        # The causal LM and its base model (whose forward makes caches too) use one CudaPath.
        for module in self.modules():
            if isinstance(module, TinyLoopPreTrainedModel):
                module._cuda_path = path

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Module:
        """As transformers' method, for unquantized tables: packed rows (QuantEmbedding, a QuantLinear head) have
        no ``weight`` to resize, so resize before quantizing."""
        packed = [
            type(module).__name__
            for module in (self.get_input_embeddings(), self.get_output_embeddings())
            if isinstance(module, PackedModule)
        ]
        if packed:
            raise ValueError(
                f"resize_token_embeddings: the model's {' and '.join(packed)} holds packed low-bit rows that cannot "
                f"be resized; resize the unquantized model, then quantize it"
            )
        return super().resize_token_embeddings(*args, **kwargs)

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        # Custom generation fields are dropped on reload when the config says it was derived from the model config.
        if getattr(self, "generation_config", None) is not None:
            self.generation_config._from_model_config = False
        super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """As transformers' ``from_pretrained``, but a missing, unexpected or mis-shaped tensor is an error that
        names it (transformers only warns about missing ones and initializes them randomly)."""
        wants_info = kwargs.pop("output_loading_info", False)
        strict = not kwargs.get("ignore_mismatched_sizes", False)
        kwargs["ignore_mismatched_sizes"] = True  # report shape errors ourselves, with the tensor names
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        unexpected = [
            key for key in info.get("unexpected_keys") or [] if not key.startswith(cls._unused_checkpoint_prefixes)
        ]
        problems = [f"missing keys: {sorted(info['missing_keys'])}"] if info.get("missing_keys") else []
        if unexpected:
            problems.append(f"unexpected keys: {sorted(unexpected)}")
        if strict and info.get("mismatched_keys"):
            problems.append(
                "shape mismatch (tensor, checkpoint shape, model shape): "
                + "; ".join(map(str, info["mismatched_keys"]))
            )
        packed = packed_shape_errors(model) if strict else []
        if packed:
            problems.append("packed tensors of the wrong shape (tensor, checkpoint, model): " + "; ".join(packed))
        if problems:
            raise ValueError(f"checkpoint does not match its TinyLoop config: {' | '.join(problems)}")
        if any(device in ("cpu", "disk") for device in (getattr(model, "hf_device_map", None) or {}).values()):
            hook_offloaded_blocks(model, TinyLoopBlock)
        return (model, info) if wants_info else model


class TinyLoopModel(TinyLoopPreTrainedModel):
    _unused_checkpoint_prefixes = ("lm_head.",)

    def __init__(self, config: TinyLoopConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.prelude_layers = nn.ModuleList(TinyLoopBlock(config) for _ in range(config.num_prelude_layers))
        self.loop_layers = nn.ModuleList(TinyLoopBlock(config) for _ in range(config.num_loop_layers))
        self.coda_layers = nn.ModuleList(TinyLoopBlock(config) for _ in range(config.num_coda_layers))
        if config.input_injection == "linear_concat":
            self.injection = TinyLoopLinear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.norm = TinyLoopRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.exit_gate:
            self.exit_gate = TinyLoopLinear(config.hidden_size, 1, bias=True)
        self.op_backend = REFERENCE  # the step's own ops (RoPE angles)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: TinyLoopCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_loops: LoopCount | None = None,
        exit_threshold: float | None = None,
        exit_at_step: int | None = None,
        cache: TinyLoopCache | None = None,
        early_exit: str | EarlyExit | None = None,
        early_exit_threshold: float | None = None,
    ) -> TinyLoopModelOutput | tuple:
        """``early_exit`` ("gate", "state_delta", "kl"; see loop_exit.EarlyExit) with ``early_exit_threshold``: at
        decode steps each row stops looping when its criterion is met, and the loops it skipped reuse its last
        computed loop's K/V (prompts run every loop). Rows past their ``num_loops`` stop computing as well."""
        if self._checkpointing() and (use_cache or past_key_values is not None or cache is not None):
            # The backward pass recomputes each block, which would write its K/V into the cache a second time.
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing: running without a cache")
            use_cache, past_key_values, cache = False, None, None
        cache = _resolve_cache(past_key_values, cache, use_cache, self.new_cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, length = hidden.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = _resolve_positions(position_ids, attention_mask, past, length, hidden.device)
        if not graph_capturing():  # a CUDA-graph capture may not synchronize
            _check_context(position_ids, self.config.max_position_embeddings)
        context = self._context(position_ids, attention_mask, cache, past, hidden)
        total_loops, loops_per_row = _resolve_loops(num_loops, self.config, batch, hidden.device)
        trained = self.config.trained_loops
        if trained is not None and total_loops > trained:
            logger.warning_once(f"num_loops={total_loops} is deeper than this checkpoint was trained at "
                                f"(trained_loops={trained}): outputs past it are extrapolation")  # fmt: skip
        exit_at_step = _check_exit_step(exit_at_step, total_loops, loops_per_row)

        if self.config.embedding_scale != 1.0:
            hidden = hidden * self.config.embedding_scale
        if exit_threshold is not None and not is_probability(exit_threshold):
            raise ValueError(f"exit_threshold must be None or a number in [0, 1], got {exit_threshold!r}")
        # early_exit replaces the config's default exit selection (an exit_threshold passed with it is refused).
        threshold = exit_threshold if early_exit is not None else _first_set(exit_threshold, self.config.exit_threshold)
        if threshold is not None and not self.config.exit_gate:
            raise ValueError("exit_threshold needs a model with an exit gate (TinyLoopConfig.exit_gate=True)")
        keep_states = bool(output_hidden_states) or exit_at_step is not None or threshold is not None
        rule = self._early_exit_rule(early_exit, early_exit_threshold, threshold, exit_at_step, cache, length, past)
        fused = None
        if loops_per_row is None and not keep_states and rule is None:
            fused = self._fused_decode(hidden, context, total_loops)
        if fused is not None:  # the whole step in one kernel (CUDA path, batch-1 decode)
            last_hidden, gates = fused
            # A captured step's replays return its logits alone (cuda_path.run), and no exit rule is in play here:
            # the exit distribution's ~18 small kernels per step would be replayed for nothing.
            states, gates = [], ([] if graph_capturing() else gates or [])
            probabilities = exit_distribution(gates, None) if gates else None
        else:
            hidden = self._run_layers(
                self.prelude_layers, hidden, context, lambda index: _slot(cache, "prelude", index)
            )
            # A captured step's replays return its logits alone (cuda_path.run), so a capture that no exit rule
            # needs gates for leaves the exit gate out (per loop, a GEMV and the exit distribution's kernels).
            gates_needed = not (graph_capturing() and rule is None and threshold is None and exit_at_step is None)
            state, states, gates, loops_run = self._run_loops(
                hidden, context, total_loops, loops_per_row, position_ids, keep_states, exit_rule=rule,
                gates_needed=gates_needed,
            )  # fmt: skip
            probabilities = exit_distribution(gates, loops_per_row) if gates else None
            if exit_at_step is not None:
                state = states[exit_at_step]
            elif threshold is not None:
                state = select_states(states, threshold_exit_steps(probabilities, threshold, loops_per_row))
            last_hidden = self.finish(state, context)
        if cache is not None:
            cache.end_step()

        hidden_states = (hidden, *states) if output_hidden_states else None
        gate_logits = torch.stack(gates, dim=2) if gates else None
        output = TinyLoopModelOutput(
            last_hidden_state=last_hidden,
            hidden_states=hidden_states,
            exit_probabilities=probabilities,
            gate_logits=gate_logits,
            loops_run=loops_run if rule is not None else None,
            **{CACHE_OUTPUT_FIELD: cache},
        )
        return output if return_dict is not False else output.to_tuple()

    def _fused_decode(
        self, hidden: torch.Tensor, context: _ForwardContext, loops: int
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None] | None:
        """(last hidden state, exit-gate logits per loop) of a decode step run as one kernel by the CUDA path, or None
        where it does not serve the step (then the layers run op by op; see kernels/fused_decode.py)."""
        path = getattr(self, "_cuda_path", None)
        if path is None or hidden.shape[1] != 1 or context.cache is None:
            return None
        return path.fused.run(hidden, context.cos, context.sin, context.cache, loops)

    def _run_loops(
        self,
        loop_input: torch.Tensor,
        context: _ForwardContext,
        total_loops: int,
        loops_per_row: torch.Tensor | None,
        position_ids: torch.Tensor,
        keep_states: bool,
        first_loop: int = 0,
        state: torch.Tensor | None = None,
        exit_rule: EarlyExit | None = None,
        gates_needed: bool = True,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        """Run the loop block (from ``first_loop`` with ``state``, or from the start): (state, states kept, gate
        logits per loop (none without ``gates_needed``), loops each row computed [B] where rows may stop early, else
        None).

        With per-row depths or an exit rule, a row stops computing once its depth is reached or the rule says so,
        and keeps its state; the loop slots it skipped (up to the cache's depth) reuse its last computed loop's K/V.
        A cache that cannot serve row subsets (the paged one, which CUDA graphs capture: no host synchronization
        here) makes every row compute every loop, rows past their depth discarding the result."""
        if state is None:
            state = self._initial_state(loop_input, position_ids)
        cache, batch = context.cache, state.shape[0]
        subsets = cache is None or cache.supports_row_subsets
        adaptive = subsets and (loops_per_row is not None or exit_rule is not None)
        running = torch.ones(batch, dtype=torch.bool, device=state.device) if adaptive else None
        last_loop = torch.full((batch,), total_loops - 1, dtype=torch.long, device=state.device) if subsets else None
        states: list[torch.Tensor] = []
        gates: list[torch.Tensor] = []
        previous = state
        for loop in range(first_loop, total_loops):
            alive = int(running.sum()) if adaptive else batch  # one host sync per loop where rows may stop
            if alive == batch:
                x = self._loop_pass(state, loop_input, context, loop)
                state = x if loops_per_row is None else torch.where((loop < loops_per_row)[:, None, None], x, state)
            elif alive:
                rows = running.nonzero().squeeze(1)
                x = self._loop_pass(state[rows], loop_input[rows], context.select(rows), loop)
                state = state.index_copy(0, rows, x)
            if self.config.exit_gate and gates_needed:
                gates.append(self.exit_gate(state).squeeze(-1))
            if keep_states:
                states.append(state)
            if adaptive:
                stop = torch.zeros_like(running)
                if loops_per_row is not None:
                    stop |= loop + 1 >= loops_per_row
                if exit_rule is not None and loop < total_loops - 1:
                    stop |= exit_rule.exits(loop, state, previous, gates[-1] if gates else None)
                last_loop = torch.where(stop & running, torch.full_like(last_loop, loop), last_loop)
                running = running & ~stop
                previous = state
        if cache is not None and not subsets and loops_per_row is not None:
            cache.fill_row_depths(loops_per_row, first_loop, total_loops)  # every row ran every loop of the step
        if cache is not None and (adaptive or cache.loops_cached() > total_loops):
            if subsets:
                cache.fill_skipped_loops(last_loop, first_loop, total_loops, context.past_length, loop_input.shape[1])
            else:  # the deeper slots take the step's last loop's K/V (each row's own last, filled above)
                cache.fill_deeper_slots(total_loops - 1)
        return state, states, gates, last_loop + 1 if adaptive else None

    def _loop_pass(
        self, state: torch.Tensor, loop_input: torch.Tensor, context: _ForwardContext, loop: int
    ) -> torch.Tensor:
        x = self._inject(state, loop_input)
        x = self._run_layers(
            self.loop_layers, x, context, lambda index, loop=loop: _slot(context.cache, "loop", index, loop)
        )
        return self.norm(x) if self.config.final_norm == "every_loop" else x

    def _early_exit_rule(
        self,
        early_exit: Any,
        threshold: Any,
        exit_threshold: Any,
        exit_at_step: Any,
        cache: Any,
        length: int,
        past: int,
    ) -> EarlyExit | None:
        """The rule of a decode step (one token per row after cached ones); prompts, a one-token prompt too, run every
        loop."""
        if early_exit is None:
            if threshold is not None:
                raise ValueError("early_exit_threshold needs early_exit (one of 'gate', 'state_delta', 'kl')")
            return None
        rule = (
            early_exit if isinstance(early_exit, EarlyExit) else EarlyExit(early_exit, threshold, self.config.exit_gate)
        )
        if exit_threshold is not None:
            raise _early_exit_conflict()
        if cache is None:
            raise ValueError("early_exit needs the KV cache (use_cache=True): the loops a token skips reuse its "
                             "cached K/V, which a forward without a cache would recompute at full depth")  # fmt: skip
        if not cache.supports_row_subsets:
            raise ValueError("early_exit needs a TinyLoopCache: a paged cache (the CUDA path's, or "
                             "PagedTinyLoopCache) runs every row through every loop; on the CUDA path, use the "
                             "reference path (model.use_reference_path())")  # fmt: skip
        if length != 1 or past == 0:
            return None
        if exit_at_step is not None:  # checked at decode steps: a loop schedule's prompt step reads a loop
            raise _early_exit_conflict()
        return rule

    def resume(
        self,
        loop_input: torch.Tensor,
        state: torch.Tensor,
        first_loop: int,
        total_loops: int,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: TinyLoopCache,
        past_length: int,
    ) -> torch.Tensor:
        """Last hidden states of tokens whose prelude and loops < ``first_loop`` already ran (a self-speculative
        verify resumes the draft's work): ``loop_input`` and ``state`` [B, S, H] are their loop input and state
        after ``first_loop`` loops. Runs loops first_loop..total_loops-1 and the coda; the cache's slots of those
        loops and of the coda hold ``past_length`` tokens, to which these S are appended."""
        context = self._context(position_ids, attention_mask, cache, past_length, state)
        state, *_ = self._run_loops(loop_input, context, total_loops, None, position_ids, False, first_loop, state)
        hidden = self.finish(state, context)
        cache.end_step()
        return hidden

    def _context(
        self,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: TinyLoopCache | None,
        past: int,
        like: torch.Tensor,
    ) -> _ForwardContext:
        """The context of a step over ``like`` [B, S, H] after ``past`` cached tokens; the cache is told it starts."""
        batch, length = like.shape[:2]
        angles = get_op("rope_angles", self.op_backend)
        cos, sin = angles(position_ids.expand(batch, -1), self.config.head_dim, self.config.rope_theta)
        mask, is_causal = _attention_mask(attention_mask, past, length, batch, like.device)
        if cache is not None:
            cache.begin_step(batch, length, attention_mask, like)
        return _ForwardContext(cos, sin, mask, is_causal, cache, past)

    def _inject(self, state: torch.Tensor, loop_input: torch.Tensor) -> torch.Tensor:
        if self.config.input_injection == "linear_concat":
            return self.injection(torch.cat((state, loop_input), dim=-1))
        if self.config.input_injection == "add":
            return state + loop_input
        return state

    def _initial_state(self, loop_input: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.config.initial_state == "input":
            return loop_input
        if self.config.initial_state == "zeros":
            return torch.zeros_like(loop_input)
        return _seeded_state(position_ids, loop_input, self.config.initial_state_std, self.config.initial_state_seed)

    def finish(self, state: torch.Tensor, context: _ForwardContext | None) -> torch.Tensor:
        """Loop state -> head input: the coda layers with the configured final norm(s) (context: None only
        for a model without coda layers)."""
        x = self.norm(state) if self.config.final_norm == "before_and_after_coda" else state
        x = self._run_layers(self.coda_layers, x, context, lambda index: _slot(context.cache, "coda", index))
        return self.norm(x) if self.config.final_norm != "every_loop" else x

    def _checkpointing(self) -> bool:
        """Whether this forward recomputes its blocks in the backward pass (gradient_checkpointing_enable())."""
        block = next(iter(self.loop_layers), None)
        return block is not None and block.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def _run_layers(
        self, layers: nn.ModuleList, x: torch.Tensor, context: _ForwardContext, slot_of: Callable[[int], int]
    ) -> torch.Tensor:
        """Blocks in sequence; each one's last junction is deferred to the next block (same math, fused there with
        the next block's input norm and QKV projection). Under gradient checkpointing each block runs whole through
        the checkpoint function (its output one tensor: nothing deferred crosses a checkpoint)."""
        if self._checkpointing():
            for index, layer in enumerate(layers):
                x = layer._gradient_checkpointing_func(layer.__call__, x, context, slot_of(index), None, False)
            return x
        deferred = None
        for index, layer in enumerate(layers):
            following = layers[index + 1] if index + 1 < len(layers) else None
            # A device map split between two blocks: the junction stays on this block's device; an offloaded block
            # (weights on meta between its calls) keeps its own junction too.
            device = layer.input_layernorm.weight.device
            defer = following is not None and following.input_layernorm.weight.device == device
            defer = defer and device.type != "meta"
            out = layer(x, context, slot_of(index), deferred, defer)
            x, deferred = out if defer else (out, None)
        return x


class TinyLoopForCausalLM(TinyLoopPreTrainedModel, TinyLoopGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TinyLoopConfig) -> None:
        super().__init__(config)
        self.model = TinyLoopModel(config)
        self.lm_head = TinyLoopLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: TinyLoopCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_loops: LoopCount | None = None,
        exit_threshold: float | None = None,
        exit_at_step: int | None = None,
        use_weighted_exit: bool | None = None,
        cache: TinyLoopCache | None = None,
        early_exit: str | None = None,
        early_exit_threshold: float | None = None,
        **loss_kwargs: Any,
    ) -> TinyLoopCausalLMOutput | tuple:
        r"""Causal LM forward.

        num_loops: loop depth for this call, an int or one value per row (rows then equal running each alone).
        exit_at_step: 0-based loop whose state feeds the head. exit_threshold: per token, the first loop whose
        cumulative exit probability reaches it (exit-gate models). use_weighted_exit: logits = sum_t p_t head(s_t).
        early_exit ("gate", "state_delta", "kl") with early_exit_threshold: decode steps stop looping per row when
        the criterion is met, saving the remaining loops (see loop_exit.EarlyExit and TinyLoopModel.forward).
        Selection priority: exit_at_step > exit_threshold > use_weighted_exit > config.exit_threshold > last loop;
        with ``labels`` and an exit gate the default is the weighted (expected) logits, as in Ouro's training.
        The cache is taken as ``past_key_values`` or ``cache`` and returned under the name the installed
        transformers reads. ``use_cache`` defaults to False unless a cache is passed.
        """
        unknown = set(loss_kwargs) - {"num_items_in_batch"}
        if unknown:
            raise TypeError(f"TinyLoopForCausalLM.forward got unexpected arguments: {sorted(unknown)}")
        if output_attentions:
            raise ValueError("output_attentions=True is not supported by TinyLoopForCausalLM")
        given_cache = cache if cache is not None else past_key_values
        graph_logits = self._graph_step(input_ids, attention_mask, position_ids, given_cache, locals())
        if graph_logits is not None:
            output = TinyLoopCausalLMOutput(logits=graph_logits, **{CACHE_OUTPUT_FIELD: given_cache})
            return output if return_dict is not False else output.to_tuple()
        weighted = self._weighted_exit(use_weighted_exit, labels, exit_at_step, exit_threshold)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=bool(output_hidden_states) or weighted,
            num_loops=num_loops,
            exit_threshold=exit_threshold,
            exit_at_step=exit_at_step,
            cache=cache,
            early_exit=self._early_exit(early_exit, early_exit_threshold),
            early_exit_threshold=early_exit_threshold,
        )
        keep = _positions_to_keep(logits_to_keep)
        if weighted:
            logits = self._expected_logits(outputs.hidden_states[1:], outputs.exit_probabilities, keep)
        else:
            logits = self.lm_head(outputs.last_hidden_state[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        output = TinyLoopCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states if output_hidden_states else None,
            exit_probabilities=outputs.exit_probabilities,
            gate_logits=outputs.gate_logits,
            loops_run=outputs.loops_run,
            **{CACHE_OUTPUT_FIELD: getattr(outputs, CACHE_OUTPUT_FIELD)},
        )
        return output if return_dict is not False else output.to_tuple()

    def _graph_step(
        self, input_ids: Any, attention_mask: Any, position_ids: Any, cache: Any, arguments: dict[str, Any]
    ) -> torch.Tensor | None:
        """Logits of a step replayed from a CUDA graph (CUDA path: decode, or a prompt), or None to run it normally."""
        path = getattr(self, "_cuda_path", None)
        if path is None:
            return None
        key = None if arguments.get("use_cache") is False else path.graph_key(input_ids, cache, arguments)
        if key is None:
            path.settle()  # an eager step: after any step run ahead (see CudaPath.run_ahead)
            return None
        return path.run(key, input_ids, attention_mask, position_ids, cache)

    def _early_exit(self, criterion: Any, threshold: Any) -> EarlyExit | None:
        """The rule, with the LM head to read next-token distributions from loop states for "kl" (final norm +
        head)."""
        if criterion is None:
            return None
        every_loop = self.config.final_norm == "every_loop"
        return EarlyExit(
            criterion,
            threshold,
            self.config.exit_gate,
            lambda state: self.lm_head(state if every_loop else self.model.norm(state)),
        )

    def _weighted_exit(
        self, use_weighted_exit: bool | None, labels: Any, exit_at_step: int | None, exit_threshold: float | None
    ) -> bool:
        if use_weighted_exit is not None and not isinstance(use_weighted_exit, bool):
            raise ValueError(f"use_weighted_exit must be True, False or None, got {use_weighted_exit!r}")
        if exit_at_step is not None or exit_threshold is not None:
            return False
        if use_weighted_exit is None:  # training default (Ouro): the expected logits where the model allows them
            use_weighted_exit = labels is not None and self.config.exit_gate and not self.config.num_coda_layers
        weighted = bool(use_weighted_exit)
        if weighted and not self.config.exit_gate:
            raise ValueError("use_weighted_exit needs a model with an exit gate (TinyLoopConfig.exit_gate=True)")
        if weighted and self.config.num_coda_layers:
            raise ValueError("use_weighted_exit needs num_coda_layers == 0 (the coda would run once per loop)")
        return weighted

    def _expected_logits(
        self, states: Sequence[torch.Tensor], probabilities: torch.Tensor, keep: slice | torch.Tensor
    ) -> torch.Tensor:
        """sum_t p_t * head(state_t), accumulated in the reference's order."""
        expected = None
        for step, state in enumerate(states):
            step_logits = self.lm_head(self.model.finish(state[:, keep], None))
            weight = probabilities[:, keep][..., step, None].to(step_logits.dtype)
            expected = step_logits * weight if expected is None else expected + step_logits * weight
        return expected

    def logits_from_state(self, state: torch.Tensor) -> torch.Tensor:
        """Logit lens: head logits of a loop state [B, S, H] from ``output_hidden_states`` (coda run without cache,
        so every position of the sequence must be present)."""
        batch, length = state.shape[:2]
        positions = torch.arange(length, device=state.device)[None]
        cos, sin = rope_angles(positions.expand(batch, -1), self.config.head_dim, self.config.rope_theta)
        context = _ForwardContext(cos, sin, None, length > 1, None, 0)
        return self.lm_head(self.model.finish(state, context))


# ----------------------------------------------------------------------------------------------------------------------
# Input resolution helpers
# ----------------------------------------------------------------------------------------------------------------------


def _slot(cache: TinyLoopCache | None, stage: str, layer: int, loop: int = 0) -> int:
    return cache.slot_index(stage, layer, loop) if cache is not None else -1


def _resolve_cache(past_key_values: Any, cache: Any, use_cache: bool | None, new_cache: Any) -> TinyLoopCache | None:
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("pass the cache as past_key_values or as cache, not both")
    given = cache if cache is not None else past_key_values
    if given is not None and not isinstance(given, TinyLoopCache):
        raise TypeError(
            f"TinyLoopForCausalLM needs a TinyLoopCache (one slot per loop and layer), got {type(given).__name__}; "
            f"create one with TinyLoopCache(model.config) or let generate() do it"
        )
    if given is None and use_cache:
        given = new_cache()
    if given is not None and use_cache is False:
        return None
    return given


def _resolve_positions(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, past: int, length: int, device: Any
) -> torch.Tensor:
    """[B or 1, S] positions: given ones, else counted over the attention mask (left padding), else past + arange."""
    if position_ids is not None:
        return position_ids.to(device)
    if attention_mask is not None:
        positions = attention_mask.long().cumsum(-1) - 1
        return positions.masked_fill(attention_mask == 0, 0)[:, -length:].to(device)
    return torch.arange(past, past + length, device=device)[None]


def _check_context(position_ids: torch.Tensor, max_positions: int) -> None:
    if position_ids.numel() and int(position_ids.max()) >= max_positions:
        raise ValueError(
            f"position {int(position_ids.max())} is beyond the context of this model "
            f"(TinyLoopConfig.max_position_embeddings={max_positions})"
        )


def _attention_mask(
    attention_mask: torch.Tensor | None, past: int, length: int, batch: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """bool [B, 1, S, past + S] mask (True = may attend) or None with an is_causal flag for the plain cases."""
    total = past + length
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, total):
            raise ValueError(
                f"attention_mask must be 2-D [batch, past + new tokens] = [{batch}, {total}], "
                f"got {tuple(attention_mask.shape)}"
            )
        if bool(attention_mask.all()):
            attention_mask = None
    if attention_mask is None and length == 1:
        return None, False
    if attention_mask is None and past == 0:
        return None, True
    query_positions = torch.arange(past, total, device=device)[:, None]
    key_positions = torch.arange(total, device=device)[None, :]
    mask = (key_positions <= query_positions)[None, None]  # [1, 1, S, T]
    if attention_mask is not None:
        # A padding query may see only itself, so its (discarded) row never becomes NaN.
        key_ok = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = (mask & key_ok) | (key_positions == query_positions)
    return mask, False


def _resolve_loops(
    num_loops: LoopCount | None, config: TinyLoopConfig, batch: int, device: Any
) -> tuple[int, torch.Tensor | None]:
    """(loops to run, per-row depths or None when all rows share the depth)."""
    allowed = f"an integer in [1, max_loops={config.max_loops}] or one such value per batch row"
    if num_loops is None:
        num_loops = config.num_loops  # validated again: it may have been edited after loading
    values = num_loops.tolist() if isinstance(num_loops, torch.Tensor) else num_loops
    if isinstance(values, (list, tuple)):
        if len(values) != batch:
            raise ValueError(f"num_loops has {len(values)} values for a batch of {batch} rows")
    else:
        values = [values]
    for value in values:
        if not is_int(value) or not 1 <= value <= config.max_loops:
            raise ValueError(f"num_loops must be {allowed}, got {num_loops!r}")
    if len(set(values)) == 1:
        return values[0], None
    return max(values), torch.tensor(values, device=device)


def _early_exit_conflict() -> ValueError:
    return ValueError("early_exit stops loops per token; it cannot be combined with exit_threshold (which computes "
                      "every loop and selects a state) or exit_at_step")  # fmt: skip


def _first_set(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _check_exit_step(exit_at_step: int | None, total_loops: int, loops_per_row: torch.Tensor | None) -> int | None:
    if exit_at_step is None:
        return None
    shallowest = total_loops if loops_per_row is None else int(loops_per_row.min())
    if not is_int(exit_at_step) or not 0 <= exit_at_step < shallowest:
        raise ValueError(
            f"exit_at_step must be an integer in [0, num_loops - 1 = {shallowest - 1}], got {exit_at_step!r}"
        )
    return exit_at_step


def _positions_to_keep(logits_to_keep: int | torch.Tensor) -> slice | torch.Tensor:
    return slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep


def _seeded_state(position_ids: torch.Tensor, like: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """Truncated-normal (+-3 std) initial state, a pure function of (seed, position): caching cannot change it."""
    unique, index = position_ids.expand(like.shape[0], -1).unique(return_inverse=True)
    table = torch.empty(len(unique), like.shape[-1], dtype=torch.float32)
    for row, position in enumerate(unique.tolist()):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + position)
        nn.init.trunc_normal_(table[row], mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
    return table.to(device=like.device, dtype=like.dtype)[index]
