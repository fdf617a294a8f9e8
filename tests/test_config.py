"""TinyLoopConfig: every architecture is fields; bad values fail at construction naming field and allowed values."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from helpers import tiny_config
from tinyloop_hf import TinyLoopConfig, TinyLoopForCausalLM


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("block_norm", "post", "block_norm must be one of \\['pre', 'sandwich', 'post_residual'\\], got 'post'"),
        ("final_norm", "after", "final_norm must be one of \\['end', 'every_loop', 'before_and_after_coda'\\]"),
        ("input_injection", "concat", "input_injection must be one of \\['none', 'linear_concat', 'add'\\]"),
        ("initial_state", "noise", "initial_state must be one of \\['input', 'zeros', 'random'\\]"),
        ("attention_bias", True, "attention_bias must be one of \\['none', 'qkv', 'qk'\\]"),
        ("rope_layout", "neox", "rope_layout must be one of \\['rotate_half', 'interleaved'\\]"),
        ("hidden_act", "gelu", "hidden_act must be one of \\['silu'\\]"),
        ("num_loops", 0, "num_loops must be an integer in \\[1, max_loops=16\\], got 0"),
        ("num_loops", 90, "num_loops must be an integer in \\[1, max_loops=16\\], got 90"),
        ("max_loops", 0, "max_loops must be an integer >= 1"),
        ("num_loop_layers", 0, "num_loop_layers must be an integer >= 1"),
        ("num_prelude_layers", -1, "num_prelude_layers must be an integer >= 0"),
        ("num_key_value_heads", 3, "num_key_value_heads must be a divisor of num_attention_heads=4"),
        ("head_dim", 7, "head_dim must be even"),
        ("rope_theta", -1.0, "rope_theta must be a number > 0"),
        ("exit_threshold", 0.5, "exit_threshold must be None when exit_gate is False"),
        ("initial_state_std", 0, "initial_state_std must be a number > 0"),
        ("vocab_size", "big", "vocab_size must be an integer >= 1"),
        ("trained_loops", 0, "trained_loops must be None or an integer >= 1, got 0"),
    ],
)
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("llama", **{"max_loops": 16, field: value})


def test_injection_none_needs_input_state():
    with pytest.raises(ValueError, match="initial_state must be 'input' when input_injection is 'none'"):
        tiny_config("llama", initial_state="zeros")


def test_exit_threshold_range():
    with pytest.raises(ValueError, match="exit_threshold must be None or a number in \\[0, 1\\]"):
        tiny_config("ouro", exit_threshold=1.5)


def test_num_hidden_layers_is_derived_and_checked():
    config = tiny_config("huginn")
    assert config.num_hidden_layers == 1 + 2 + 1
    with pytest.raises(ValueError, match="num_hidden_layers is derived"):
        TinyLoopConfig(num_loop_layers=2, num_hidden_layers=5)


def test_defaults_follow_the_injection():
    assert tiny_config("huginn").initial_state == "zeros"
    assert tiny_config("llama").initial_state == "input"
    assert TinyLoopConfig(num_loops=8).max_loops == 32


def test_round_trip_through_auto_config(tmp_path):
    config = tiny_config("huginn", num_loops=5, max_loops=12)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, TinyLoopConfig)
    for field in (
        "num_loops",
        "max_loops",
        "block_norm",
        "final_norm",
        "input_injection",
        "rope_layout",
        "embedding_scale",
        "num_prelude_layers",
        "num_coda_layers",
        "tie_word_embeddings",
    ):
        assert getattr(loaded, field) == getattr(config, field), field
    assert loaded.auto_map["AutoModelForCausalLM"] == "modeling_tinyloop.TinyLoopForCausalLM"
    assert (tmp_path / "configuration_tinyloop.py").exists() and (tmp_path / "modeling_tinyloop.py").exists()


def test_from_pretrained_overrides_are_validated(tmp_path):
    tiny_config("ouro").save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, num_loops=2).num_loops == 2
    with pytest.raises(ValueError, match="num_loops must be"):
        AutoConfig.from_pretrained(tmp_path, num_loops=99)


def test_save_refuses_a_field_edited_to_a_value_loading_would_refuse(tmp_path):
    config = tiny_config("ouro")
    config.num_loops = config.max_loops + 1
    with pytest.raises(ValueError, match="num_loops must be"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_a_depth_past_the_trained_one_warns_once(caplog):
    import logging as std_logging

    from transformers.utils import logging

    model = TinyLoopForCausalLM(tiny_config("ouro", trained_loops=2))
    ids = torch.tensor([[1, 2, 3]])
    root = logging.get_logger("transformers")
    propagate, root.propagate = root.propagate, True  # transformers' loggers do not reach caplog otherwise
    try:
        with caplog.at_level(std_logging.WARNING):
            model(ids, num_loops=2)
            assert "deeper than this checkpoint was trained at" not in caplog.text
            model(ids, num_loops=3)
            model(ids, num_loops=3)
    finally:
        root.propagate = propagate
    assert caplog.text.count("num_loops=3 is deeper than this checkpoint was trained at (trained_loops=2)") == 1
