"""TinyLoopForCausalLM.forward: runtime depth, per-row depth, logit lens, exit selection, loss, errors."""

from __future__ import annotations

import pytest
import torch

from helpers import VARIANTS, tiny_model
from tinyloop_hf import TinyLoopCache

IDS = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_depth_changes_output_at_runtime(variant):
    model = tiny_model(variant)
    with torch.no_grad():
        shallow, deep, default = (model(IDS, num_loops=1).logits, model(IDS, num_loops=3).logits, model(IDS).logits)
        again = model(IDS, num_loops=model.config.num_loops).logits
    assert not torch.allclose(shallow, deep)
    assert torch.equal(default, again)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_per_row_depth_equals_each_row_alone(variant):
    model = tiny_model(variant)
    depths = [1, 4, 2]
    with torch.no_grad():
        mixed = model(IDS, num_loops=depths)
        for row, depth in enumerate(depths):
            alone = model(IDS[row : row + 1], num_loops=depth)
            assert torch.allclose(mixed.logits[row], alone.logits[0], atol=1e-5), (row, depth)
            if model.config.exit_gate:
                probabilities = mixed.exit_probabilities[row, :, :depth]
                assert torch.allclose(probabilities, alone.exit_probabilities[0], atol=1e-6)
                assert torch.all(mixed.exit_probabilities[row, :, depth:] == 0)


def test_per_row_depth_as_tensor_and_uniform_list():
    model = tiny_model("huginn")
    with torch.no_grad():
        as_list = model(IDS, num_loops=[2, 3, 1]).logits
        as_tensor = model(IDS, num_loops=torch.tensor([2, 3, 1])).logits
        uniform = model(IDS, num_loops=[2, 2, 2]).logits
        scalar = model(IDS, num_loops=2).logits
    assert torch.equal(as_list, as_tensor)
    assert torch.equal(uniform, scalar)


@pytest.mark.parametrize("variant", ["llama", "huginn"])
def test_logits_to_keep(variant):
    model = tiny_model(variant)
    with torch.no_grad():
        full = model(IDS).logits
        last = model(IDS, logits_to_keep=1).logits
        picked = model(IDS, logits_to_keep=torch.tensor([0, 4])).logits
    assert last.shape == (3, 1, 256) and torch.allclose(last, full[:, -1:], atol=1e-6)
    assert torch.allclose(picked, full[:, [0, 4]], atol=1e-6)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hidden_states_are_loop_states_for_the_logit_lens(variant):
    model = tiny_model(variant)
    with torch.no_grad():
        output = model(IDS, num_loops=3, output_hidden_states=True)
        assert len(output.hidden_states) == 1 + 3
        for loop in (1, 2, 3):
            lens = model.logits_from_state(output.hidden_states[loop])
            assert torch.allclose(lens, model(IDS, num_loops=loop).logits, atol=1e-5), loop


def test_exit_at_step_selects_that_loop():
    model = tiny_model("ouro")
    with torch.no_grad():
        for step in range(3):
            selected = model(IDS, num_loops=3, exit_at_step=step).logits
            assert torch.allclose(selected, model(IDS, num_loops=step + 1).logits, atol=1e-5)


def test_exit_threshold_extremes():
    model = tiny_model("ouro")
    with torch.no_grad():
        first = model(IDS, exit_threshold=0.0).logits
        last = model(IDS, exit_threshold=1.0).logits
        assert torch.allclose(first, model(IDS, num_loops=1).logits, atol=1e-5)
        assert torch.allclose(last, model(IDS).logits, atol=1e-5)


def test_weighted_exit_is_the_expected_logits():
    model = tiny_model("ouro")
    with torch.no_grad():
        output = model(IDS, use_weighted_exit=True)
        per_loop = torch.stack([model(IDS, num_loops=t).logits for t in (1, 2, 3)], dim=2)  # [B, S, T, V]
        expected = (per_loop * output.exit_probabilities[..., None]).sum(2)
    assert torch.allclose(output.logits, expected, atol=1e-5)
    assert torch.allclose(output.exit_probabilities.sum(-1), torch.ones(3, 10), atol=1e-6)


def test_labels_loss_is_shifted_cross_entropy():
    model = tiny_model("llama")
    labels = IDS.clone()
    labels[:, :3] = -100
    output = model(IDS, labels=labels)
    expected = torch.nn.functional.cross_entropy(output.logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1))
    assert torch.allclose(output.loss, expected, atol=1e-6)
    output.loss.backward()
    assert model.model.loop_layers[0].self_attn.q_proj.weight.grad is not None


def test_labels_with_exit_gate_train_on_expected_logits():
    model = tiny_model("ouro")
    with torch.no_grad():
        trained = model(IDS, labels=IDS)
        weighted = model(IDS, use_weighted_exit=True)
    assert torch.allclose(trained.logits, weighted.logits, atol=1e-6)


def test_return_dict_false_gives_a_tuple():
    model = tiny_model("llama")
    with torch.no_grad():
        output = model(IDS, return_dict=False)
    assert isinstance(output, tuple) and torch.equal(output[0], model(IDS).logits)


def test_inputs_embeds_equal_input_ids():
    model = tiny_model("huginn")
    with torch.no_grad():
        embeds = model.get_input_embeddings()(IDS)
        assert torch.allclose(model(inputs_embeds=embeds).logits, model(IDS).logits, atol=1e-6)


def test_cache_returned_only_when_asked():
    model = tiny_model("ouro")
    with torch.no_grad():
        assert model(IDS).past_key_values is None
        cache = model(IDS, use_cache=True).past_key_values
    assert isinstance(cache, TinyLoopCache) and cache.get_seq_length() == 10
    # 2 loop-block layers x 3 loops = 6 slots
    assert len(cache.layers) == 6 and cache.loops_cached() == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_loops=0), "num_loops must be an integer in \\[1, max_loops=16\\]"),
        (dict(num_loops=17), "num_loops must be an integer in \\[1, max_loops=16\\]"),
        (dict(num_loops=2.5), "num_loops must be"),
        (dict(num_loops=[1, 2]), "num_loops has 2 values for a batch of 3 rows"),
        (dict(num_loops=[1, 0, 2]), "num_loops must be"),
        (dict(exit_at_step=3), "exit_at_step must be an integer in \\[0, num_loops - 1 = 2\\]"),
        (dict(output_attentions=True), "output_attentions"),
        (dict(num_loopz=2), "unexpected arguments: \\['num_loopz'\\]"),
    ],
)
def test_bad_arguments_fail_clearly(kwargs, message):
    model = tiny_model("ouro")
    with pytest.raises((ValueError, TypeError), match=message):
        model(IDS, **kwargs)


def test_exit_features_need_an_exit_gate():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="exit_gate"):
        model(IDS, exit_threshold=0.5)
    with pytest.raises(ValueError, match="exit_gate"):
        model(IDS, use_weighted_exit=True)


def test_context_beyond_max_position_embeddings_fails():
    model = tiny_model("llama")  # max_position_embeddings=128
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        model(torch.ones(1, 129, dtype=torch.long))
    model(torch.ones(1, 128, dtype=torch.long))


def test_wrong_cache_type_fails_clearly():
    from transformers import DynamicCache

    model = tiny_model("ouro")
    with pytest.raises(TypeError, match="needs a TinyLoopCache"):
        model(IDS, past_key_values=DynamicCache())


def test_bf16_runs_and_stays_close():
    model = tiny_model("huginn")
    with torch.no_grad():
        reference = model(IDS).logits
        low = model.to(torch.bfloat16)(IDS).logits
    assert low.dtype == torch.bfloat16
    assert (low.float() - reference).abs().max().item() < 0.5


@pytest.mark.parametrize("variant", ["ouro", "huginn"])
def test_resize_token_embeddings_keeps_old_rows(variant):
    model = tiny_model(variant)
    with torch.no_grad():
        before = model(IDS).logits
    model.resize_token_embeddings(300)
    assert model.get_input_embeddings().weight.shape[0] == 300 and model.lm_head.weight.shape[0] == 300
    assert model.config.vocab_size == 300
    with torch.no_grad():
        after = model(IDS).logits
    assert torch.allclose(after[..., :256], before, atol=1e-5)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_captured_step_leaves_the_exit_gate_out_unless_an_exit_needs_it(monkeypatch):
    """Inside a CUDA-graph capture (whose replays return logits alone) the exit gate is not computed: the same
    logits, no gate outputs; an exit threshold still gets its gates."""
    from tinyloop_hf import modeling_tinyloop

    model = tiny_model("ouro")
    gate_calls = []
    model.model.exit_gate.register_forward_hook(lambda *args: gate_calls.append(1))
    with torch.no_grad():
        plain = model.model(IDS)
        assert plain.exit_probabilities is not None and len(gate_calls) == model.config.num_loops
        gate_calls.clear()
        monkeypatch.setattr(modeling_tinyloop, "graph_capturing", lambda: True)
        captured = model.model(IDS)
        assert not gate_calls and captured.exit_probabilities is None and captured.gate_logits is None
        assert torch.equal(captured.last_hidden_state, plain.last_hidden_state)
        threshold = model.model(IDS, exit_threshold=0.5)
        assert len(gate_calls) == model.config.num_loops and threshold.exit_probabilities is not None


def test_labels_give_a_loss_on_a_model_with_a_coda_and_an_exit_gate():
    """Weighted exit (Ouro's training loss) is the default only where the model allows it: a coda would run once per
    loop, so such a model's loss is the last loop's, and an explicit use_weighted_exit=False is honoured."""
    model = tiny_model("tinyloop")  # prelude, loop, coda, exit gate
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
        assert torch.isfinite(loss) and torch.equal(model(ids, labels=ids, use_weighted_exit=False).loss, loss)
    with pytest.raises(ValueError, match="use_weighted_exit needs num_coda_layers == 0"):
        model(ids, labels=ids, use_weighted_exit=True)
