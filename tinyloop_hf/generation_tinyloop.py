"""generate() integration: loop fields in generation_config reach forward, and generate always gets a TinyLoopCache;
the decoding fields (self-speculation, loop schedules, constraints) are checked when generate() starts and served
by the hooks below.

transformers keeps unknown generation_config entries but never passes them to forward, and a call keyword of the
same name is swallowed into the config once the field exists. We copy the resolved value into the model kwargs.
Precedence: ``generate(num_loops=...)`` > ``generate(generation_config=...)`` > ``model.generation_config``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList

from .cache_tinyloop import TinyLoopCache
from .compat import GENERATE_CACHE_KEY
from .configuration_tinyloop import is_int
from .constraints.constrained import (
    CONSTRAINT_FIELDS,
    ConstrainedLogitsProcessor,
    compiled_constraint,
    constraint_pattern,
)
from .constraints.grammar import GrammarLogitsProcessor, check_grammar, compile_grammar
from .speculative import SPECULATION_FIELDS, check_speculation_fields, full_depth, self_speculative_sample

CONSTRAINT_PROCESSORS = (ConstrainedLogitsProcessor, GrammarLogitsProcessor)
SCHEDULE_FIELDS = ("warmup_tokens", "warmup_loops")  # served by prepare_inputs_for_generation
# generation_config fields forwarded to forward() (each is an explicit forward parameter).
LOOP_GENERATION_FIELDS = (
    "num_loops", "exit_threshold", "exit_at_step", "use_weighted_exit", "early_exit", "early_exit_threshold"
)  # fmt: skip


class TinyLoopGenerationMixin(GenerationMixin):
    def _prepare_generation_config(
        self, generation_config: GenerationConfig | None, *args: Any, **kwargs: Any
    ) -> tuple[GenerationConfig, dict[str, Any]]:
        if kwargs.get("assistant_early_exit") is not None:
            raise ValueError(
                "assistant_early_exit truncates layers inside each loop of a looped model and is not supported; "
                "draft with fewer loops through the draft_loops generation field instead (self-speculative decoding)"
            )
        called = [field for field in CONSTRAINT_FIELDS if kwargs.get(field) is not None]
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        if getattr(generation_config, "is_assistant", False):
            self._own_decoding_fields(generation_config)
        for field in SPECULATION_FIELDS + SCHEDULE_FIELDS + CONSTRAINT_FIELDS:  # decoding settings, not forward()
            if model_kwargs.get(field) is not None:  # arguments: kept on the call's config
                setattr(generation_config, field, model_kwargs.pop(field))
        if called:  # a constraint passed to this call replaces the one the saved generation config holds
            for field in set(CONSTRAINT_FIELDS) - set(called):
                setattr(generation_config, field, None)
        constraint_pattern(generation_config)  # an invalid regex / schema / choices list fails here
        if getattr(generation_config, "grammar", None) is not None:
            check_grammar(generation_config.grammar)  # ... and a grammar that does not parse
        for field in LOOP_GENERATION_FIELDS:
            value = getattr(generation_config, field, None)
            if value is not None and model_kwargs.get(field) is None:
                model_kwargs[field] = value
        if isinstance(model_kwargs.get("num_loops"), (list, tuple)):
            # A tensor is expanded with the batch for beams / num_return_sequences; a list would not be.
            model_kwargs["num_loops"] = torch.tensor(model_kwargs["num_loops"], dtype=torch.long)
        loops = full_depth(self, model_kwargs)
        loops = loops.tolist() if isinstance(loops, torch.Tensor) else loops
        check_speculation_fields(generation_config, loops, self.config.max_loops)
        schedule = self._loop_schedule(generation_config, loops, model_kwargs.get("exit_at_step"))
        if schedule is not None:
            model_kwargs["loop_schedule"] = schedule
        return generation_config, model_kwargs

    def _own_decoding_fields(self, generation_config: GenerationConfig) -> None:
        """As another model's assistant, this model gets a copy of the target's generation config: its loop fields
        are this model's own again, and the target's decoding fields are dropped (the target's constraint processor
        is in the logits processors handed over; speculation and warm-up schedules are the target's business)."""
        for field in LOOP_GENERATION_FIELDS:
            setattr(generation_config, field, getattr(self.generation_config, field, None))
        for field in SPECULATION_FIELDS + SCHEDULE_FIELDS + CONSTRAINT_FIELDS:
            setattr(generation_config, field, None)

    def _extract_generation_mode_kwargs(self, custom_generate: Any, kwargs: dict[str, Any], *args: Any) -> Any:
        # generate(tokenizer=...) is taken here, before the logits processors are built: keep it for the constraint.
        self._generate_tokenizer = kwargs.get("tokenizer")
        return super()._extract_generation_mode_kwargs(custom_generate, kwargs, *args)

    def _get_logits_processor(self, generation_config: GenerationConfig, *args: Any, **kwargs: Any) -> Any:
        """The constraint (regex / json_schema / choices / grammar) runs first among the user's processors: before
        the sampling warpers, so top-k / top-p only see allowed tokens."""
        given = kwargs.get("logits_processor") or []
        if any(isinstance(p, CONSTRAINT_PROCESSORS) for p in given):  # an assistant gets the target's processors
            return super()._get_logits_processor(generation_config, *args, **kwargs)
        processor = self._constraint_processor(generation_config)
        if processor is not None:
            kwargs["logits_processor"] = LogitsProcessorList([processor, *(kwargs.get("logits_processor") or [])])
        return super()._get_logits_processor(generation_config, *args, **kwargs)

    def _constraint_processor(self, generation_config: GenerationConfig) -> Any:
        pattern = constraint_pattern(generation_config)
        grammar = getattr(generation_config, "grammar", None)
        tokenizer, self._generate_tokenizer = getattr(self, "_generate_tokenizer", None), None
        if pattern is None and grammar is None:
            return None
        if tokenizer is None:
            tokenizer = self._own_tokenizer()
        eos = generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if not eos:  # a complete match could then only be cut by max_new_tokens, past which nothing is allowed
            raise ValueError(
                "regex / json_schema / choices / grammar need an end-of-sequence token to finish on: set "
                "generation_config.eos_token_id or pass generate(eos_token_id=...)"
            )
        pad = generation_config.pad_token_id
        pad = None if pad is None else int(pad)
        vocab = self.config.vocab_size
        if grammar is not None:
            return GrammarLogitsProcessor(compile_grammar(grammar, tokenizer, vocab, eos), vocab, pad)
        return ConstrainedLogitsProcessor(compiled_constraint(pattern, tokenizer, eos, vocab), pad)

    def _own_tokenizer(self) -> Any:
        """The tokenizer saved beside the weights, loaded once per model (the compiled constraints are cached per
        tokenizer object, so a fresh one every call would recompile them)."""
        from transformers import AutoTokenizer

        source = getattr(self, "name_or_path", "") or ""
        loaded = self.__dict__.get("_loaded_tokenizer")
        if loaded is not None and loaded[0] == source:
            return loaded[1]
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as error:
            raise ValueError(
                "regex / json_schema / choices need the tokenizer: pass generate(tokenizer=...) (this model has no "
                f"tokenizer files at {source!r})"
            ) from error
        self.__dict__["_loaded_tokenizer"] = (source, tokenizer)
        return tokenizer

    def _loop_schedule(
        self, generation_config: GenerationConfig, full_loops: Any, exit_at_step: Any
    ) -> dict[str, Any] | None:
        """warmup_tokens / warmup_loops: the first warmup_tokens generated tokens are decoded at warmup_loops loops
        (the prompt itself runs every loop; the first token is read from its state at warmup_loops, and so are the
        prompt's coda and coda K/V where the model has a coda), the rest at full depth. Loops a warm-up token skipped
        reuse its last computed loop's K/V."""
        tokens = getattr(generation_config, "warmup_tokens", None)
        loops = getattr(generation_config, "warmup_loops", None)
        if tokens is None and loops is None:
            return None
        if tokens is None or loops is None:
            raise ValueError("a loop schedule needs both warmup_tokens and warmup_loops")
        if generation_config.use_cache is False:
            raise ValueError(
                "warmup_tokens / warmup_loops need the KV cache (use_cache=True): a warm-up token's skipped loops "
                "reuse its cached K/V, which a forward without a cache would recompute"
            )
        if not is_int(tokens) or tokens < 0:
            raise ValueError(f"warmup_tokens must be a non-negative integer, got {tokens!r}")
        if not is_int(full_loops):
            raise ValueError(f"warmup_loops needs one num_loops for every row (an integer), got {full_loops!r}")
        if not is_int(loops) or not 1 <= loops <= full_loops:
            raise ValueError(f"warmup_loops must be an integer in [1, num_loops={full_loops}], got {loops!r}")
        if getattr(generation_config, "draft_loops", None) is not None:
            raise ValueError("warmup_tokens / warmup_loops cannot be combined with draft_loops")
        if exit_at_step is not None:
            raise ValueError("warmup_tokens / warmup_loops choose the depth of each step; do not pass exit_at_step")
        return {"tokens": tokens, "loops": loops, "prompt_length": None, "prefilling": False}

    def _prefill(self, input_ids: torch.LongTensor, generation_config: GenerationConfig, model_kwargs: dict[str, Any],
                 *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        """The prompt forward, in prefill_chunk_size chunks or whole: a loop schedule counts generated tokens from
        the whole prompt's length, and each chunk runs every loop."""
        schedule = model_kwargs.get("loop_schedule")
        if schedule is None:
            return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        schedule["prompt_length"], schedule["prefilling"] = input_ids.shape[1], True
        try:
            return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        finally:
            schedule["prefilling"] = False

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        *args: Any,
        inputs_embeds: torch.Tensor | None = None,
        loop_schedule: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``inputs_embeds`` is named so that generate() sees forward() takes it (it reads this signature)."""
        for name in ("tokenizer", "assistant_tokenizer"):  # generate() hands these to the decoding loop, not forward
            kwargs.pop(name, None)
        inputs = super().prepare_inputs_for_generation(input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)
        # Set by _prefill, which greedy, sampling and beam search call (assisted and self-speculative decoding refuse
        # schedules).
        if loop_schedule is not None and loop_schedule["tokens"]:
            if loop_schedule["prefilling"]:  # the prompt runs every loop; its next token is read at the warm-up depth
                inputs["exit_at_step"] = loop_schedule["loops"] - 1
            elif input_ids.shape[1] - loop_schedule["prompt_length"] < loop_schedule["tokens"]:
                inputs["num_loops"] = loop_schedule["loops"]
        return inputs

    def _sample(
        self,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        streamer: Any = None,
        **model_kwargs: Any,
    ) -> Any:
        """Greedy and sampling decoding; self-speculative when the draft_loops generation field is set."""
        if getattr(generation_config, "draft_loops", None) is None:
            path = getattr(self, "_cuda_path", None)
            ahead = nullcontext()
            constrained = any(isinstance(p, CONSTRAINT_PROCESSORS) for p in logits_processor)
            # Greedy on the CUDA path; a constraint changes the argmax at most steps, so guessing it would not pay.
            if path is not None and not generation_config.do_sample and not synced_gpus and not constrained:
                pad = getattr(generation_config, "_pad_token_tensor", None)
                ahead = path.run_ahead(pad, getattr(generation_config, "_eos_token_tensor", None))
            with ahead:
                return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                                       synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)  # fmt: skip
        if synced_gpus:
            raise ValueError("draft_loops does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)")
        return self_speculative_sample(
            self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs
        )

    def _get_candidate_generator(self, generation_config: GenerationConfig, *args: Any, **kwargs: Any) -> Any:
        """Assisted decoding (assistant_model, prompt_lookup_num_tokens) verifies several tokens per forward at one
        depth: per-step depths (a warm-up schedule, early exit) would change its output, so they are refused. The
        loop fields are this model's, not the assistant's (it keeps its own)."""
        if getattr(generation_config, "draft_loops", None) is not None:
            raise ValueError("draft_loops drafts with the model itself; do not pass an assistant_model as well")
        model_kwargs = kwargs.get("model_kwargs", {})
        for name, field in (("loop_schedule", "warmup_tokens / warmup_loops"), ("early_exit", "early_exit")):
            if model_kwargs.get(name) is not None:
                raise ValueError(
                    f"{field} sets a depth per decode step, which assisted decoding (assistant_model / "
                    "prompt_lookup_num_tokens) cannot keep: it verifies several tokens in one forward"
                )
        if "model_kwargs" in kwargs:
            skip = set(LOOP_GENERATION_FIELDS) | {"loop_schedule"}
            kwargs["model_kwargs"] = {key: value for key, value in model_kwargs.items() if key not in skip}
        return super()._get_candidate_generator(generation_config, *args, **kwargs)

    def _prepare_cache_for_generation(
        self, generation_config: GenerationConfig, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        given = model_kwargs.get(GENERATE_CACHE_KEY)
        if given is not None and not isinstance(given, TinyLoopCache):
            raise TypeError(
                f"TinyLoopForCausalLM needs a TinyLoopCache (one slot per loop and layer), got {type(given).__name__}"
            )
        if given is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported by TinyLoop "
                f"models; leave it unset (generate then uses a TinyLoopCache)"
            )
        model_kwargs[GENERATE_CACHE_KEY] = self.new_cache(capacity=generation_config.max_length)
        return None
