"""Quantize a TinyLoopForCausalLM in place: round-to-nearest, or GPTQ calibrated on local text.

GPTQ walks the model in execution order and quantizes one layer at a time from Hessians of its real inputs:
prelude layers, then each loop-block layer j (its Hessian sums the inputs of *every* loop, since the same weights
serve all of them; layers before j are already quantized in every loop), then coda layers and the head. The token
embedding, when selected, is a lookup table with no input activations and so no Hessian: it is rounded to nearest
under both methods, first, so that GPTQ calibrates every layer on what the quantized embedding produces.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from tinyloop_hf import TinyLoopForCausalLM
from tinyloop_hf.modeling_tinyloop import _ForwardContext
from tinyloop_hf.ops_tinyloop import rope_angles
from tinyloop_hf.quant_tinyloop import PackedWeight, quantize_rtn
from tinyloop_hf.quantizer_tinyloop import (
    TinyLoopQuantConfig,
    check_targets,
    quantization_targets,
    swap_in_quantized,
    tied_components,
)

from .gptq import HessianAccumulator, gptq_quantize


def quantize_model(
    model: TinyLoopForCausalLM,
    config: TinyLoopQuantConfig,
    calibration: torch.Tensor | None = None,
    *,
    batch_size: int = 8,
    progress: bool = True,
) -> TinyLoopForCausalLM:
    """Replace the linears selected by ``config`` with QuantLinear, and the token embedding with QuantEmbedding
    when ``config`` selects ``embed_tokens``; ``calibration``: token ids [n, T] for GPTQ."""
    check_targets(model, config)  # fail before any work is done
    if config.method == "gptq" and calibration is None:
        raise ValueError("GPTQ needs calibration token ids (tinyloop-convert --calib FILE)")
    if tied_components(model, config):
        # The head and the embedding stop sharing one tensor: each keeps its own copy, quantized or not.
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)  # now empty
    targets = quantization_targets(model, config)
    if config.method == "gptq":
        for name, module in targets.items():
            if isinstance(module, nn.Embedding):  # no Hessian for a lookup table (see the module docstring)
                _swap(model, name, module, quantize_rtn(module.weight, config.format_for(name)), config)
        _GPTQ(model, config, calibration, batch_size, progress).run()
    else:
        for name, module in tqdm(targets.items(), desc="RTN", disable=not progress):
            _swap(model, name, module, quantize_rtn(module.weight, config.format_for(name)), config)
    model.config.quantization_config = config
    return model


def _target(config: TinyLoopQuantConfig, name: str, module: nn.Module) -> bool:
    """A linear that GPTQ quantizes (the embedding is rounded to nearest before GPTQ starts)."""
    return isinstance(module, nn.Linear) and config.format_for(name) is not None


def _swap(model: nn.Module, name: str, module: nn.Module, packed: PackedWeight, config: TinyLoopQuantConfig) -> None:
    quantized = swap_in_quantized(model, name, module, config.format_for(name))
    quantized.load_packed(packed)
    if getattr(module, "bias", None) is not None:
        quantized.bias = nn.Parameter(module.bias.detach().clone())
    quantized.to(module.weight.device)


class _GPTQ:
    """Layer-by-layer GPTQ over cached calibration activations."""

    def __init__(
        self,
        model: TinyLoopForCausalLM,
        config: TinyLoopQuantConfig,
        ids: torch.Tensor,
        batch_size: int,
        progress: bool,
    ) -> None:
        self.model, self.config, self.batch_size = model, config, batch_size
        self.device = next(model.parameters()).device
        self.ids = ids.to(self.device)
        length = ids.shape[1]
        if length > model.config.max_position_embeddings:
            raise ValueError(f"calibration sequences of {length} tokens exceed max_position_embeddings")
        self.positions = torch.arange(length, device=self.device)[None]
        layers = model.model
        steps = len(layers.prelude_layers) + len(layers.loop_layers) + len(layers.coda_layers) + 2
        self.bar = tqdm(total=steps, desc="GPTQ", disable=not progress)

    def _context(self, batch: int) -> _ForwardContext:
        cos, sin = rope_angles(
            self.positions.expand(batch, -1), self.model.config.head_dim, self.model.config.rope_theta
        )
        return _ForwardContext(cos, sin, None, self.positions.shape[1] > 1, None, 0)

    def _batches(self, tensor: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        for start in range(0, tensor.shape[0], self.batch_size):
            part = slice(start, start + self.batch_size)
            yield part, tensor[part]

    @torch.no_grad()
    def run(self) -> None:
        inner = self.model.model
        hidden = inner.embed_tokens(self.ids) * inner.config.embedding_scale
        for index, layer in enumerate(inner.prelude_layers):
            step = lambda batch, x, layer=layer: layer(x, self._context(batch), -1)  # noqa: E731
            self._quantize_under(f"model.prelude_layers.{index}", step, hidden)
            hidden = self._map(step, hidden)
        if inner.config.num_loops == 1:
            state = self._single_loop(hidden)
        else:
            loops = lambda batch, x: inner._run_loops(  # noqa: E731
                x, self._context(batch), inner.config.num_loops, None, self.positions, False
            )[0]
            for prefix in ["model.injection", *(f"model.loop_layers.{j}" for j in range(len(inner.loop_layers)))]:
                self._quantize_under(prefix, loops, hidden)
            state = self._map(loops, hidden)
        finish = lambda batch, x: inner.finish(x, self._context(batch))  # noqa: E731
        for index in range(len(inner.coda_layers)):
            self._quantize_under(f"model.coda_layers.{index}", finish, state)
        head_input = self._map(finish, state)
        self._quantize_under("lm_head", lambda batch, x: self.model.lm_head(x), head_input)
        self.bar.close()

    def _single_loop(self, loop_input: torch.Tensor) -> torch.Tensor:
        """One loop (plain decoders): layer inputs are cached between layers, as in standard sequential GPTQ."""
        inner = self.model.model
        start = lambda batch, e: inner._inject(inner._initial_state(e, self.positions), e)  # noqa: E731
        self._quantize_under("model.injection", start, loop_input)
        x = self._map(start, loop_input)
        for index, layer in enumerate(inner.loop_layers):
            step = lambda batch, h, layer=layer: layer(h, self._context(batch), -1)  # noqa: E731
            self._quantize_under(f"model.loop_layers.{index}", step, x)
            x = self._map(step, x)
        return inner.norm(x) if inner.config.final_norm == "every_loop" else x

    def _map(self, fn, inputs: torch.Tensor) -> torch.Tensor:
        return torch.cat([fn(part.shape[0], part) for _, part in self._batches(inputs)])

    def _quantize_under(self, prefix: str, fn, inputs: torch.Tensor) -> None:
        """Run ``fn`` over the calibration batches, collecting Hessians of every target linear under ``prefix``
        (all of its calls, e.g. one per loop), then GPTQ-quantize those linears."""
        targets = {
            name: module
            for name, module in self.model.named_modules()
            if (name == prefix or name.startswith(prefix + ".")) and _target(self.config, name, module)
        }
        if targets:
            accumulators = {
                name: HessianAccumulator(module.in_features, self.device) for name, module in targets.items()
            }
            hooks = [
                module.register_forward_hook(lambda m, args, out, acc=accumulators[name]: acc.add(args[0]))
                for name, module in targets.items()
            ]
            try:
                for _, part in self._batches(inputs):
                    fn(part.shape[0], part)
            finally:
                for hook in hooks:
                    hook.remove()
            for name, module in targets.items():
                packed = gptq_quantize(module.weight, accumulators[name].hessian, self.config.format_for(name))
                _swap(self.model, name, module, packed, self.config)
        self.bar.update(1)
