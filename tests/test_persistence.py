"""Placement, training and hub uploads as transformers users drive them: offloaded blocks (accelerate), gradient
checkpointing, a config pushed on its own, a quantized checkpoint loaded as the base model."""

from __future__ import annotations

import os
import types

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from helpers import VARIANTS, tiny_model
from tinyloop_hf import TinyLoopQuantConfig
from tinyloop_hf.convert import quantize_model

IDS = torch.tensor([[1, 5, 9, 22, 7, 3], [4, 4, 8, 1, 2, 3]])


def _saved(model: torch.nn.Module, path: os.PathLike) -> str:
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_offloaded_blocks_run_and_equal_the_resident_model(variant, tmp_path):
    """device_map entries "disk" (one loop block; then the whole model through max_memory): transformers hooks the
    leaves, the block reads its norm weights itself, so the blocks are re-hooked whole (tinyloop_hf/offload.py)."""
    model = tiny_model(variant)
    path = _saved(model, tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.norm": "cpu"}
    for name, module in model.model.named_children():
        if isinstance(module, torch.nn.ModuleList):
            device_map |= {f"model.{name}.{index}": "cpu" for index in range(len(module))}
        elif name not in ("embed_tokens", "norm"):
            device_map[f"model.{name}"] = "cpu"
    device_map[f"model.loop_layers.{len(model.model.loop_layers) - 1}"] = "disk"  # a block every variant has
    one = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "one"))
    whole = AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={"cpu": "20KB"}, offload_folder=str(tmp_path / "whole")
    )
    assert "disk" in one.hf_device_map.values() and set(whole.hf_device_map.values()) == {"disk"}
    with torch.no_grad():
        want = model(IDS).logits
        for offloaded in (one, whole):
            assert torch.equal(offloaded(IDS).logits, want)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(one.generate(IDS, **kwargs), model.generate(IDS, **kwargs))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(variant, reentrant):
    plain, checkpointed = tiny_model(variant).train(), tiny_model(variant).train()
    checkpointed.load_state_dict(plain.state_dict())
    # transformers renamed gradient_* to activation_* (the old names warn on newer releases; 5.17 has only them).
    kwargs = {"use_reentrant": reentrant}
    if hasattr(type(checkpointed), "activation_checkpointing_enable"):
        checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        assert checkpointed.is_activation_checkpointing
    else:
        checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert checkpointed.is_gradient_checkpointing
    want = plain(IDS, labels=IDS)
    want.loss.backward()
    recomputed = []
    for block in checkpointed.modules():
        if hasattr(block, "_gradient_checkpointing_func"):
            original = block._gradient_checkpointing_func
            block._gradient_checkpointing_func = lambda *a, _f=original, **k: recomputed.append(1) or _f(*a, **k)
    got = checkpointed(IDS, labels=IDS, use_cache=True)  # the cache is dropped: the backward pass recomputes blocks
    got.loss.backward()
    assert recomputed and got.past_key_values is None
    assert torch.equal(got.loss, want.loss)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, name
        else:
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name
    checkpointed.eval()
    with torch.no_grad():  # generation in eval mode keeps its cache
        assert torch.equal(checkpointed.generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=0),
                           plain.eval().generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=0))  # fmt: skip


def test_a_config_pushed_on_its_own_uploads_the_files_its_auto_map_names(tmp_path, monkeypatch):
    """config.save_pretrained(push_to_hub=True): the upload (stubbed) holds configuration_tinyloop.py and
    modeling_tinyloop.py, which transformers' own push inside its save would have missed."""
    from transformers.utils import hub

    uploads = []

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        uploads.append((repo_id, sorted(os.listdir(working_dir))))

    api = types.SimpleNamespace(create_repo=lambda repo_id, **kwargs: types.SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(hub, "hf_api", lambda: api)  # the one client transformers' hub calls go through
    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", upload)
    tiny_model("ouro").config.save_pretrained(tmp_path / "config", push_to_hub=True, repo_id="me/config")
    assert uploads and uploads[-1][0] == "me/config"
    assert {"config.json", "configuration_tinyloop.py", "modeling_tinyloop.py"} <= set(uploads[-1][1])


def test_a_quantized_checkpoint_loads_as_the_base_model(tmp_path):
    """AutoModel (TinyLoopModel: module names without the "model." prefix) on a quantized checkpoint."""
    quantized = quantize_model(tiny_model("ouro", hidden_size=64, intermediate_size=64),
                               TinyLoopQuantConfig(bits=4, group_size=32), progress=False)  # fmt: skip
    path = _saved(quantized, tmp_path)
    base = AutoModel.from_pretrained(path)
    assert type(base.loop_layers[0].mlp.up_proj).__name__ == "QuantLinear"
    with torch.no_grad():
        assert torch.equal(base(IDS).last_hidden_state, quantized.model(IDS).last_hidden_state)


def test_accelerate_moves_a_forward_context_with_its_tensors_and_keeps_its_cache():
    """A device map over several GPUs: accelerate's hooks send a block's arguments to its device through .to(); the
    context's angles and mask move, its cache stays the one object every block writes."""
    from accelerate.utils import send_to_device

    from tinyloop_hf import TinyLoopCache
    from tinyloop_hf.modeling_tinyloop import _ForwardContext

    model = tiny_model("ouro")
    cache = TinyLoopCache(model.config)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    context = _ForwardContext(torch.zeros(1, 3, 4), torch.ones(1, 3, 4), mask, False, cache, 0)
    assert send_to_device(context, "cpu") is context
    moved = send_to_device(context, "meta")
    assert moved.cache is cache and moved.cos.is_meta and moved.mask.is_meta and moved.past_length == 0
