"""Grammar-constrained decoding through xgrammar (optional dependency): the ``grammar`` generation field (EBNF in
xgrammar's syntax, root rule ``root``).

As for the regex constraint, a row's matcher is a function of its generated prefix: matchers are kept by prefix and
a new prefix forks its parent's matcher and accepts one token, so rolled-back drafts, beams and finished rows need no
bookkeeping. xgrammar fills the token bitmask of each row and applies it to the logits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import LogitsProcessor

from .constrained import RecentPrefixes, check_some_token_allowed


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as error:
        raise ValueError(
            "the grammar field needs xgrammar: pip install 'tinyloop-hf[grammar]' (or xgrammar)"
        ) from error
    return xgrammar


def compile_grammar(grammar: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """xgrammar's CompiledGrammar of ``grammar`` for this tokenizer (cached); a bad grammar fails naming the error."""
    return _compiled(grammar, tokenizer, vocab_size, tuple(eos_token_ids))


@functools.lru_cache(maxsize=16)
def _compiled(grammar: str, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    xgrammar = _xgrammar()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=list(eos_token_ids) or None)  # fmt: skip
    try:
        return xgrammar.GrammarCompiler(info).compile_grammar(grammar)
    except Exception as error:  # xgrammar raises its own types (RuntimeError, ValueError) for grammar errors
        raise ValueError(f"grammar does not compile: {error}") from None


def check_grammar(grammar: Any) -> None:
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError(
            f"grammar must be a non-empty EBNF string (xgrammar syntax, root rule 'root'), got {grammar!r}"
        )
    xgrammar = _xgrammar()
    try:
        xgrammar.Grammar.from_ebnf(grammar)
    except Exception as error:
        raise ValueError(f"grammar does not parse: {error}") from None


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks the tokens the grammar does not allow after each row's generated prefix. Matchers are kept for recent
    prefixes only (RecentPrefixes: memory linear in the output length), and a row generate() has stopped and pads
    with ``pad_token_id`` ends there instead of failing the grammar."""

    def __init__(self, compiled: Any, vocab_size: int, pad_token_id: int | None = None) -> None:
        xgrammar = _xgrammar()
        self._xgrammar, self.vocab_size, self.pad_token_id = xgrammar, vocab_size, pad_token_id
        self.matchers = RecentPrefixes(xgrammar.GrammarMatcher(compiled))
        self.prompt_length: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        prefixes = [tuple(row) for row in input_ids[:, self.prompt_length :].tolist()]
        matchers = [self._matcher(prefix) for prefix in prefixes]
        self.matchers.record(prefixes, matchers)
        bitmask = self._xgrammar.allocate_token_bitmask(len(prefixes), self.vocab_size)
        constrained = []
        for index, matcher in enumerate(matchers):
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, index)
                constrained.append(index)
        if not constrained:  # every row has finished: generate() pads them
            return scores
        scores = scores.clone()
        self._xgrammar.apply_token_bitmask_inplace(scores, bitmask.to(scores.device), vocab_size=self.vocab_size,
                                                   indices=constrained)  # fmt: skip
        check_some_token_allowed(scores, constrained)
        return scores

    def _matcher(self, prefix: tuple[int, ...]) -> Any:
        """The matcher after ``prefix`` (None once the row has ended): a fork of its longest recent prefix's, fed the
        tokens after it (the kept matcher is never advanced itself)."""
        cut, matcher = self.matchers.longest(prefix)
        if matcher is None or cut == len(prefix):
            return matcher
        matcher = matcher.fork()
        for token in prefix[cut:]:
            if matcher.is_terminated():
                return None
            if not matcher.accept_token(token):
                if token == self.pad_token_id:
                    return None  # generate() pads a row it stopped
                raise ValueError(f"token {token} is outside the grammar (forced by another processor?)")
        return matcher
