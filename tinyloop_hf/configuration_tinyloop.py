"""TinyLoopConfig: one description for every looped (and plain) decoder we support.

A model is ``embed -> prelude layers -> num_loops x (injection + loop block) -> coda layers -> head``. Ouro, Huginn,
Llama/Qwen2 (L = 1) and native TinyLoop models differ only in the fields below; no field names a model family.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from transformers import PreTrainedConfig

from .remote_code import AUTO_MAP, write_remote_code

# Allowed values of the enumerated fields; the first entry of each is the default.
BLOCK_NORMS = ("pre", "sandwich", "post_residual")
FINAL_NORMS = ("end", "every_loop", "before_and_after_coda")
INPUT_INJECTIONS = ("none", "linear_concat", "add")
INITIAL_STATES = ("input", "zeros", "random")
ATTENTION_BIASES = ("none", "qkv", "qk")
ROPE_LAYOUTS = ("rotate_half", "interleaved")
HIDDEN_ACTS = ("silu",)


def _require(condition: bool, field: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"TinyLoopConfig.{field} must be {allowed}, got {value!r}")


def _require_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    _require(value in choices, field, f"one of {list(choices)}", value)


def is_int(value: Any) -> bool:
    """An int that is not a bool (True is an int to Python, not a loop count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_probability(value: Any) -> bool:
    """A number (not a bool) in [0, 1]: an exit threshold."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0


class TinyLoopConfig(PreTrainedConfig):
    r"""Configuration of a looped decoder.

    Stages:
        num_prelude_layers: unique layers run once before the loop (Huginn: 2).
        num_loop_layers: the block re-applied ``num_loops`` times (Ouro: all 24 layers; Llama: all layers, L = 1).
        num_coda_layers: unique layers run once after the loop (Huginn: 2).
        num_loops / max_loops: default depth and the largest depth a call may ask for.
        trained_loops: the deepest depth the checkpoint was trained at, where known (Ouro: total_ut_steps); a deeper
            forward logs a warning once (quality past it is extrapolation). None: not known, no warning.

    Block variants:
        block_norm: "pre" (Llama: ``x + f(N1 x)``), "sandwich" (Ouro: ``x + N2 f(N1 x)``) or "post_residual"
            (Huginn: ``N2(x + f(N1 x))``); the same placement is used for the MLP with N3/N4.
        final_norm: where the shared final RMSNorm runs: "end" (before the head), "every_loop" (Ouro: after every
            pass, so the normed state feeds the next pass and the exit gate) or "before_and_after_coda" (Huginn ln_f).
        input_injection: how the prelude output ``e`` re-enters every loop: "none" (the state starts as ``e``),
            "linear_concat" (Huginn adapter: ``W [s; e]``) or "add" (``s + e``).
        initial_state: loop state before the first pass: "input" (= ``e``, required when input_injection is
            "none"), "zeros" (Huginn with init_scale = 0) or "random" (truncated normal, seeded per position by
            ``initial_state_seed`` so cached and uncached runs agree), with std ``initial_state_std``.
        exit_gate: Ouro's ``Linear(hidden, 1)`` on each pass's state; ``exit_threshold`` is its default CDF threshold.
        attention_bias: "none", "qkv" (Qwen2) or "qk" (Huginn's learned q/k bias).
        rope_layout: "rotate_half" (Llama/Ouro) or "interleaved" (Huginn's complex-pair layout); ``rope_theta``.
        embedding_scale: multiplies the token embedding (Huginn: sqrt(hidden_size)).
    """

    model_type: ClassVar[str] = "tinyloop"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_attention_heads: int = 9,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        num_prelude_layers: int = 0,
        num_loop_layers: int = 4,
        num_coda_layers: int = 0,
        num_loops: int = 1,
        max_loops: int | None = None,
        trained_loops: int | None = None,
        block_norm: str = "pre",
        final_norm: str = "end",
        input_injection: str = "none",
        initial_state: str | None = None,
        initial_state_std: float = 1.0,
        initial_state_seed: int = 0,
        exit_gate: bool = False,
        exit_threshold: float | None = None,
        attention_bias: str = "none",
        rope_layout: str = "rotate_half",
        rope_theta: float = 10000.0,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 2048,
        embedding_scale: float = 1.0,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        num_hidden_layers = kwargs.pop("num_hidden_layers", None)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else _default_head_dim(hidden_size, num_attention_heads)
        self.num_prelude_layers = num_prelude_layers
        self.num_loop_layers = num_loop_layers
        self.num_coda_layers = num_coda_layers
        self.num_loops = num_loops
        self.max_loops = max_loops if max_loops is not None else _default_max_loops(num_loops)
        self.trained_loops = trained_loops
        self.block_norm = block_norm
        self.final_norm = final_norm
        self.input_injection = input_injection
        self.initial_state = initial_state if initial_state is not None else _default_initial_state(input_injection)
        self.initial_state_std = initial_state_std
        self.initial_state_seed = initial_state_seed
        self.exit_gate = exit_gate
        self.exit_threshold = exit_threshold
        self.attention_bias = attention_bias
        self.rope_layout = rope_layout
        self.rope_theta = rope_theta
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.embedding_scale = embedding_scale
        self.tie_word_embeddings = tie_word_embeddings
        self.initializer_range = initializer_range
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.use_cache = use_cache
        self.validate_tinyloop()
        if num_hidden_layers is not None and num_hidden_layers != self.num_hidden_layers:
            raise ValueError(
                f"TinyLoopConfig.num_hidden_layers is derived (prelude + loop + coda = {self.num_hidden_layers}), "
                f"got {num_hidden_layers!r}"
            )
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(**kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoConfig") -> None:
        """No-op: checkpoints carry import shims (``remote_code.py``), never copies of this package's code."""

    def validate(self) -> None:
        """transformers' checks, then TinyLoop's: save_pretrained runs this before writing, so a field edited to a
        value from_pretrained would refuse (num_loops past max_loops, say) fails the save, not a later load."""
        parent = getattr(super(), "validate", None)
        if parent is not None:
            parent()
        self.validate_tinyloop()

    def save_pretrained(self, save_directory: Any, *args: Any, push_to_hub: bool = False, **kwargs: Any) -> None:
        """As transformers' save_pretrained, plus the import shims auto_map names. With ``push_to_hub`` the folder is
        uploaded once it is complete: transformers uploads inside its save, before the shims would exist."""
        super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)
        if push_to_hub:
            repo_id = kwargs.pop("repo_id", os.path.basename(os.path.normpath(str(save_directory))))
            hub_fields = ("commit_message", "commit_description", "private", "token", "revision", "create_pr")
            self.push_to_hub(repo_id, **{name: kwargs[name] for name in hub_fields if name in kwargs})

    @property
    def num_hidden_layers(self) -> int:
        """Unique layers (what other code such as lm-eval reads); the loop block counts once."""
        return self.num_prelude_layers + self.num_loop_layers + self.num_coda_layers

    def kv_slots(self, loops: int) -> int:
        """K/V slots a forward of ``loops`` loops writes: one per prelude / coda layer and per (loop, loop-block
        layer), numbered in that order (TinyLoopCache.slot_index)."""
        return self.num_prelude_layers + self.num_coda_layers + loops * self.num_loop_layers

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["num_hidden_layers"] = self.num_hidden_layers
        return output

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """As PreTrainedConfig.from_dict; overrides such as ``from_pretrained(path, num_loops=8)`` are validated too."""
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        config.validate_tinyloop()
        return loaded

    def validate_tinyloop(self) -> None:
        """Raise ValueError naming the first field whose value is not allowed."""
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_loop_layers",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            _require(is_int(value) and value >= 1, field, "an integer >= 1", value)
        for field in ("num_prelude_layers", "num_coda_layers"):
            value = getattr(self, field)
            _require(is_int(value) and value >= 0, field, "an integer >= 0", value)
        # Before max_loops, whose default is derived from num_loops.
        _require(is_int(self.num_loops), "num_loops", "an integer >= 1", self.num_loops)
        _require(is_int(self.max_loops) and self.max_loops >= 1, "max_loops", "an integer >= 1", self.max_loops)
        _require(
            is_int(self.num_loops) and 1 <= self.num_loops <= self.max_loops,
            "num_loops",
            f"an integer in [1, max_loops={self.max_loops}]",
            self.num_loops,
        )
        _require(
            self.trained_loops is None or (is_int(self.trained_loops) and self.trained_loops >= 1),
            "trained_loops",
            "None or an integer >= 1",
            self.trained_loops,
        )
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"a divisor of num_attention_heads={self.num_attention_heads}",
            self.num_key_value_heads,
        )
        _require(self.head_dim % 2 == 0, "head_dim", "even (RoPE rotates pairs)", self.head_dim)
        _require_choice("block_norm", self.block_norm, BLOCK_NORMS)
        _require_choice("final_norm", self.final_norm, FINAL_NORMS)
        _require_choice("input_injection", self.input_injection, INPUT_INJECTIONS)
        _require_choice("initial_state", self.initial_state, INITIAL_STATES)
        _require_choice("attention_bias", self.attention_bias, ATTENTION_BIASES)
        _require_choice("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        _require_choice("hidden_act", self.hidden_act, HIDDEN_ACTS)
        if self.input_injection == "none":
            _require(
                self.initial_state == "input",
                "initial_state",
                "'input' when input_injection is 'none' (otherwise the loop never sees the tokens)",
                self.initial_state,
            )
        _require(
            isinstance(self.initial_state_std, (int, float)) and self.initial_state_std > 0,
            "initial_state_std",
            "a number > 0",
            self.initial_state_std,
        )
        _require(is_int(self.initial_state_seed), "initial_state_seed", "an integer", self.initial_state_seed)
        _require(isinstance(self.exit_gate, bool), "exit_gate", "a bool", self.exit_gate)
        if self.exit_threshold is not None:
            _require(self.exit_gate, "exit_threshold", "None when exit_gate is False", self.exit_threshold)
            _require(
                is_probability(self.exit_threshold),
                "exit_threshold",
                "None or a number in [0, 1]",
                self.exit_threshold,
            )
        for field in ("rope_theta", "rms_norm_eps", "embedding_scale", "initializer_range"):
            value = getattr(self, field)
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                field,
                "a number > 0",
                value,
            )
        _require(isinstance(self.tie_word_embeddings, bool), "tie_word_embeddings", "a bool", self.tie_word_embeddings)


def _default_head_dim(hidden_size: Any, num_attention_heads: Any) -> Any:
    if is_int(hidden_size) and is_int(num_attention_heads) and num_attention_heads > 0:
        _require(
            hidden_size % num_attention_heads == 0,
            "head_dim",
            f"given when hidden_size={hidden_size} is not a multiple of num_attention_heads={num_attention_heads}",
            None,
        )
        return hidden_size // num_attention_heads
    return None


def _default_max_loops(num_loops: Any) -> Any:
    return max(16, 4 * num_loops) if is_int(num_loops) else num_loops


def _default_initial_state(input_injection: str) -> str:
    return "input" if input_injection == "none" else "zeros"
