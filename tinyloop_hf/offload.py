"""Offloaded blocks (``device_map`` entries "cpu" beside a GPU, or "disk"): accelerate's hooks moved to block level.

transformers dispatches an offloaded model with accelerate hooks on its leaf modules, which load a leaf's weights
only while that leaf runs. A TinyLoop block reads its norm weights itself, for the fused junction ops, without calling
the norm modules, so those weights would still be on the meta device. Here every offloaded TinyLoopBlock gets one hook
that loads all of its weights for the block's call (what accelerate's ``preload_module_classes`` does; transformers
does not pass it).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def hook_offloaded_blocks(model: nn.Module, block_class: type) -> int:
    """Replace the leaf hooks of each offloaded ``block_class`` module of ``model`` by one block-level hook; returns
    how many blocks were re-hooked (0 when nothing is offloaded)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_submodules
    from accelerate.utils import PrefixedDataset

    count = 0
    for name, block in model.named_modules():
        if not isinstance(block, block_class):
            continue
        leaf = _first_offloading_hook(block)
        if leaf is None:
            continue
        remove_hook_from_submodules(block)
        weights = PrefixedDataset(leaf.weights_map.dataset, f"{name}.")
        hook = AlignDevicesHook(
            execution_device=leaf.execution_device, offload=True, weights_map=weights, place_submodules=True
        )
        add_hook_to_module(block, hook)
        count += 1
    return count


def _first_offloading_hook(block: nn.Module) -> Any:
    """The accelerate hook of one of ``block``'s modules that offloads weights (None: the block is resident)."""
    for module in block.modules():
        hook = getattr(module, "_hf_hook", None)
        for candidate in getattr(hook, "hooks", (hook,)):  # a SequentialHook holds several
            if getattr(candidate, "offload", False) and getattr(candidate, "weights_map", None) is not None:
                return candidate
    return None
