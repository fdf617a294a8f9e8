"""Self-speculative decoding for looped models: draft with fewer loops, verify with all of them.

Turned on by the generation field ``draft_loops`` (``generate(draft_loops=2)`` or ``generation_config.draft_loops``);
``num_draft_tokens`` is a number or "adaptive" (start at 4; +2 after a round where every draft was accepted, -1
otherwise; between 1 and 16). It serves the modes transformers runs through ``_sample`` (greedy and sampling).

A round, with ``x`` the last token (not yet in the cache) and P tokens cached at full depth in every slot:
1. Draft: x, d_1, ..., d_k each run through the prelude, loops < draft_loops and the coda (one token per forward);
   d_1..d_k are chosen from the processed draft logits. Their K/V of the prelude and of those loops are what the
   full-depth model computes for the same tokens (a loop only reads its own and earlier loops), so they stay.
2. Verify: the draft's coda K/V (computed from a shallower state) are dropped; the k + 1 positions resume from the
   draft's loop input and state at loops draft_loops..L-1 and the coda in one forward.
3. Accept: greedy keeps drafts while they equal the verifier's choice, then the verifier's token; sampling accepts
   d_i with probability min(1, p_i(d_i) / q_i(d_i)) on the processed distributions, resamples a rejection from
   norm(max(0, p - q)), and adds a bonus token from p when all k were accepted (Leviathan et al. 2023): the output
   distribution is exactly that of plain decoding. In a batch every row emits as many tokens as the row that
   accepted the fewest (an accepted draft is a valid sample of its position, so this stays exact); the cache is
   cropped to what was emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache_tinyloop import TinyLoopCache
from .compat import GENERATE_CACHE_KEY, GENERATE_OUTPUT_CACHE_FIELD
from .configuration_tinyloop import is_int

SPECULATION_FIELDS = ("draft_loops", "num_draft_tokens")
ADAPTIVE = "adaptive"
ADAPTIVE_START, ADAPTIVE_MAX = 4, 16


@dataclass
class SpeculationStats:
    """What the last self-speculative generate() did (``model.speculation_stats``)."""

    draft_loops: int
    full_loops: int
    rounds: int = 0
    drafted: int = 0  # draft tokens proposed, summed over the rows still generating
    accepted: int = 0  # of those, accepted by the verifier (before the batch's shortest acceptance is applied)
    emitted: int = 0  # tokens appended per row, summed over rounds (the first token after the prompt excluded)
    draft_lengths: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0


def full_depth(model: Any, model_kwargs: dict[str, Any]) -> Any:
    """The verifier's loop count: the num_loops generation field, else the config's."""
    loops = model_kwargs.get("num_loops")
    return model.config.num_loops if loops is None else loops


def check_speculation_fields(generation_config: GenerationConfig, full_loops: Any, max_loops: int) -> None:
    """Fail when generate() starts: the field, its value and what is allowed."""
    draft_loops = getattr(generation_config, "draft_loops", None)
    draft_tokens = getattr(generation_config, "num_draft_tokens", None)
    if draft_loops is None:
        if draft_tokens is not None:
            raise ValueError("num_draft_tokens needs draft_loops (the draft depth), which turns speculation on")
        return
    if not is_int(full_loops):
        raise ValueError(
            f"draft_loops needs one num_loops for every row (an integer), got num_loops={full_loops!r}; "
            f"run rows of different depths in separate generate() calls"
        )
    if not is_int(draft_loops) or not 1 <= draft_loops <= full_loops:
        raise ValueError(
            f"draft_loops must be an integer in [1, num_loops={full_loops}] (max_loops={max_loops}), "
            f"got {draft_loops!r}"
        )
    adaptive = draft_tokens is None or draft_tokens == ADAPTIVE
    if not adaptive and (not is_int(draft_tokens) or draft_tokens < 1):
        raise ValueError(f"num_draft_tokens must be a positive integer or {ADAPTIVE!r}, got {draft_tokens!r}")
    if generation_config.num_beams != 1:
        raise ValueError(f"draft_loops needs num_beams=1 (self-speculation drafts one sequence per row), got "
                         f"num_beams={generation_config.num_beams}")  # fmt: skip
    if getattr(generation_config, "prompt_lookup_num_tokens", None) is not None:
        raise ValueError("draft_loops and prompt_lookup_num_tokens are two drafting methods; set one of them")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("draft_loops does not return attentions or hidden states; unset output_attentions / "
                         "output_hidden_states")  # fmt: skip


def self_speculative_sample(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer: Any,
    model_kwargs: dict[str, Any],
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    cache = model_kwargs.get(GENERATE_CACHE_KEY)
    _check_model_kwargs(model, cache, model_kwargs)
    full_loops = full_depth(model, model_kwargs)
    draft_loops = generation_config.draft_loops
    draft_tokens = getattr(generation_config, "num_draft_tokens", None)
    adaptive = draft_tokens is None or draft_tokens == ADAPTIVE
    k_now = ADAPTIVE_START if adaptive else draft_tokens
    longest_verify = cache.max_continuation_tokens(model.config) or ADAPTIVE_MAX + 1  # tokens a verify may append
    stats = SpeculationStats(draft_loops=draft_loops, full_loops=full_loops)
    model.speculation_stats = stats

    do_sample = generation_config.do_sample
    pad = generation_config._pad_token_tensor
    has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores: tuple = ()
    raw_logits: tuple = ()
    mask = model_kwargs.get("attention_mask")
    batch = input_ids.shape[0]
    unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)

    # Prefill at full depth (tokens already in a given cache are skipped, as generate() does).
    cached = cache.get_seq_length()
    logits = model(input_ids=input_ids[:, cached:], attention_mask=mask, past_key_values=cache, use_cache=True,
                   num_loops=full_loops, logits_to_keep=1).logits[:, -1].float()  # fmt: skip

    def emit(tokens: torch.Tensor, processed: torch.Tensor, raw: torch.Tensor) -> bool:
        """Append one token per row as _sample does; True when every row has stopped."""
        nonlocal input_ids, mask, unfinished, scores, raw_logits
        if has_eos:
            tokens = tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
        if want_scores:
            scores += (processed,)
        if want_logits:
            raw_logits += (raw,)
        if streamer is not None:
            streamer.put(tokens.cpu())
        unfinished = unfinished & ~stopping_criteria(input_ids, scores if want_scores else None)
        return bool(unfinished.max() == 0)

    processed = logits_processor(input_ids, logits)
    done = emit(_choose(processed, do_sample), processed, logits)
    while not done:
        k = max(0, min(k_now, generation_config.max_length - input_ids.shape[1] - 1, longest_verify - 1))
        past = cache.get_seq_length()  # P: every slot holds the same tokens between rounds
        # RoPE positions of x, d_1, ..., d_k: the draft runs them one by one, the verifier all at once.
        positions = _token_positions(mask, input_ids.shape[1], k + 1, input_ids.device).expand(batch, -1)
        drafts, draft_probs, loop_inputs, states = _draft(
            model, input_ids, mask, positions, cache, logits_processor, k, draft_loops, do_sample
        )
        verify_raw = _verify(model, cache, mask, positions, past, k, loop_inputs, states, draft_loops, full_loops)
        # Processed target scores at each of the k + 1 positions, on the prefix that position sees.
        prefix = torch.cat([input_ids, drafts], dim=-1)
        verify_scores = torch.stack(
            [logits_processor(prefix[:, : input_ids.shape[1] + i], verify_raw[:, i]) for i in range(k + 1)], dim=1
        )
        row_accepts = _accepted_drafts(drafts, draft_probs, verify_scores, do_sample)
        accepts, running = torch.stack([row_accepts, unfinished]).tolist()  # one host sync per round
        live = [count for count, on in zip(accepts, running, strict=True) if on]
        accepted = min(live, default=0)
        stats.rounds += 1
        stats.drafted += k * len(live)
        stats.accepted += sum(live)
        stats.draft_lengths.append(k)
        final = _correction(accepted, draft_probs, verify_scores, do_sample)  # where the shortest acceptance ends
        emitted = 0
        for i in range(accepted + 1):
            # Position i: the draft where this row accepted it (rows accepting more than the batch's shortest
            # acceptance), the correction / bonus token where the row's acceptance ends here.
            if i < accepted:
                token = drafts[:, i]
            elif i < k:
                token = torch.where(row_accepts > i, drafts[:, i], final)
            else:
                token = final
            emitted += 1
            done = emit(token, verify_scores[:, i], verify_raw[:, i])
            if done:
                break
        stats.emitted += emitted
        # Keep x and the emitted tokens but the last (plain decoding caches all but the newest token).
        cache.crop(-(k + 1 - emitted))
        if adaptive:
            k_now = min(k_now + 2, ADAPTIVE_MAX) if accepted == k else max(k_now - 1, 1)

    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return input_ids
    return GenerateDecoderOnlyOutput(
        sequences=input_ids,
        scores=scores if want_scores else None,
        logits=raw_logits if want_logits else None,
        **{GENERATE_OUTPUT_CACHE_FIELD: cache},
    )


def _check_model_kwargs(model: Any, cache: Any, model_kwargs: dict[str, Any]) -> None:
    if not isinstance(cache, TinyLoopCache):
        raise ValueError("draft_loops needs the KV cache (use_cache=True): drafts and verifier share it")
    for name in ("exit_threshold", "exit_at_step", "use_weighted_exit", "early_exit"):
        value = model_kwargs.get(name)
        if value is not None and value is not False:  # exit_at_step=0 and exit_threshold=0.0 are requests too
            raise ValueError(f"draft_loops verifies at a fixed depth and cannot be combined with {name}")
    if model.config.exit_threshold is not None:
        raise ValueError(
            "draft_loops verifies at a fixed depth, but this model's config sets exit_threshold="
            f"{model.config.exit_threshold} (adaptive exit); set model.config.exit_threshold = None to speculate"
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("draft_loops needs input_ids (not inputs_embeds)")


def _choose(processed: torch.Tensor, do_sample: bool) -> torch.Tensor:
    if do_sample:
        return torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1).squeeze(1)
    return processed.argmax(dim=-1)


def _graph_path(model: Any, cache: TinyLoopCache) -> Any:
    """The model's CUDA path when it can replay draft steps and verifies on ``cache`` as CUDA graphs, else None."""
    path = getattr(model, "_cuda_path", None)
    return path if path is not None and path.serves_steps(cache) else None


def _token_positions(mask: torch.Tensor | None, length: int, tokens: int, device: torch.device) -> torch.Tensor:
    """RoPE positions [B or 1, tokens] of the last token of a sequence of ``length`` and the ``tokens`` - 1 after it
    (left padding is not counted: the positions follow the attention mask)."""
    if mask is None:
        return torch.arange(length - 1, length - 1 + tokens, device=device)[None]
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], tokens - 1)], dim=-1)
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -tokens:]


def _draft(
    model: Any,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor,
    cache: TinyLoopCache,
    logits_processor: LogitsProcessorList,
    k: int,
    draft_loops: int,
    do_sample: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
    """k draft tokens [B, k] (and their processed probabilities [B, k, V] when sampling); the loop input and state
    after draft_loops loops of x, d_1, ..., d_k (the last forward computes d_k's, not a new draft). ``positions``
    [B, k + 1]: the RoPE positions of x, d_1, ..., d_k."""
    batch = input_ids.shape[0]
    token, prefix = input_ids[:, -1:], input_ids
    path = _graph_path(model, cache)
    drafts: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    loop_inputs: list[torch.Tensor] = []
    states: list[torch.Tensor] = []

    def step(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Draft logits [B, V] (fp32), loop input and state [B, 1, H] of one token; the attention mask is None on
        the graph path (the paged cache knows where each row starts) and the step's mask otherwise."""
        out = model.model(input_ids=inputs["ids"], attention_mask=inputs.get("mask"), position_ids=inputs["positions"],
                          cache=cache, use_cache=True, num_loops=draft_loops, output_hidden_states=True)  # fmt: skip
        return model.lm_head(out.last_hidden_state[:, -1]).float(), out.hidden_states[0], out.hidden_states[-1]

    cache.fill_deeper_loops = False  # the verifier computes the deeper loops of these tokens
    try:
        for i in range(k + 1):
            inputs = {"ids": token, "positions": positions[:, i : i + 1]}
            if path is not None:
                logits, loop_input, state = path.continuation_step(("draft", batch, draft_loops), inputs, cache, step)
            else:
                if mask is not None:
                    inputs["mask"] = torch.cat([mask, mask.new_ones(batch, i)], dim=-1)
                logits, loop_input, state = step(inputs)
            loop_inputs.append(loop_input)
            states.append(state)
            if i == k:
                break
            processed = logits_processor(prefix, logits)
            if do_sample:
                probs.append(torch.softmax(processed, dim=-1))
                token = torch.multinomial(probs[-1], num_samples=1)
            else:
                token = processed.argmax(dim=-1, keepdim=True)
            drafts.append(token)
            prefix = torch.cat([prefix, token], dim=-1)
    finally:
        cache.fill_deeper_loops = True
    draft_ids = torch.cat(drafts, dim=-1) if drafts else input_ids.new_empty(batch, 0)
    return draft_ids, torch.stack(probs, dim=1) if probs else None, loop_inputs, states


def _verify(
    model: Any,
    cache: TinyLoopCache,
    mask: torch.Tensor | None,
    positions: torch.Tensor,
    past: int,
    k: int,
    loop_inputs: list[torch.Tensor],
    states: list[torch.Tensor],
    draft_loops: int,
    full_loops: int,
) -> torch.Tensor:
    """Raw target logits [B, k + 1, V] (fp32) of x, d_1, ..., d_k, resuming the draft at loop draft_loops."""
    cache.prepare_resume(k + 1)  # the draft's coda K/V of these tokens came from a shallower state
    batch = loop_inputs[0].shape[0]
    inputs = {"loop_input": torch.cat(loop_inputs, dim=1), "state": torch.cat(states, dim=1), "positions": positions}
    path = _graph_path(model, cache)
    if mask is not None and path is None:
        inputs["mask"] = torch.cat([mask, mask.new_ones(batch, k)], dim=-1)  # x is the last column of the mask

    def step(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        hidden = model.model.resume(inputs["loop_input"], inputs["state"], draft_loops, full_loops,
                                    inputs["positions"], inputs.get("mask"), cache, past)  # fmt: skip
        return (model.lm_head(hidden).float(),)

    if path is not None:
        return path.continuation_step(("verify", batch, k + 1, draft_loops, full_loops), inputs, cache, step)[0]
    return step(inputs)[0]


def _accepted_drafts(
    drafts: torch.Tensor, draft_probs: torch.Tensor | None, verify_scores: torch.Tensor, do_sample: bool
) -> torch.Tensor:
    """Drafts each row accepts [B]: greedy, while they equal the verifier's argmax; sampling, each with probability
    min(1, p / q) on the processed distributions, up to the first rejection."""
    batch, k = drafts.shape
    if not k:
        return drafts.new_zeros(batch)
    if do_sample:
        p_draft = torch.softmax(verify_scores[:, :k], dim=-1).gather(-1, drafts[..., None]).squeeze(-1)
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        accepted = torch.rand_like(p_draft) * q_draft < p_draft
    else:
        accepted = drafts == verify_scores[:, :k].argmax(dim=-1)
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def _correction(
    position: int, draft_probs: torch.Tensor | None, verify_scores: torch.Tensor, do_sample: bool
) -> torch.Tensor:
    """Each row's token at ``position`` where its acceptance ends there [B]: the verifier's choice (greedy); the
    residual norm(max(0, p - q)) after a rejection, or a bonus token from p when every draft was accepted."""
    if not do_sample:
        return verify_scores[:, position].argmax(dim=-1)
    p = torch.softmax(verify_scores[:, position], dim=-1)
    if position < verify_scores.shape[1] - 1:
        residual = (p - draft_probs[:, position]).clamp(min=0)
        total = residual.sum(dim=-1, keepdim=True)
        p = torch.where(total > 0, residual / total.clamp(min=1e-30), p)  # p == q: sample from p
    return torch.multinomial(p, num_samples=1).squeeze(1)
