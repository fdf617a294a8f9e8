"""Token-level constrained decoding: a logits processor that allows only tokens keeping the output inside a pattern.

The automaton state of a row is a function of the tokens generated so far (memoized by prefix), never of the
processor's call history: rolled-back speculative drafts, beams that swap rows and finished rows cost nothing. Per
state, the allowed tokens are found once by walking a byte trie of the vocabulary through the DFA (dead branches are
pruned) and stored as a packed int32 bitmask row on the model's device; the masks of recently used states are also
kept unpacked as additive 0 / -inf rows, so a step costs a prefix lookup and one add.
End-of-sequence is allowed only in accepting states (and is the only choice where the pattern cannot continue).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import torch
from transformers import LogitsProcessor
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .json_schema import schema_to_regex
from .regex_automaton import ByteDFA, literal_pattern

CONSTRAINT_FIELDS = ("regex", "json_schema", "choices", "grammar")  # grammar: through xgrammar (grammar.py)
_FINISHED = -2  # a row that already emitted end-of-sequence: any token (generate() pads it anyway)
MAX_UNPACKED = 128  # unpacked masks kept per compiled constraint: 128 x 49k fp32 = 25 MB


def constraint_pattern(generation_config: Any) -> str | None:
    """The regex of the constraint fields of a generation config (None without one, or for a grammar); invalid
    ones fail here."""
    given = {name: getattr(generation_config, name, None) for name in CONSTRAINT_FIELDS}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"set one of regex, json_schema, choices, grammar; got {sorted(given)}")
    name, value = next(iter(given.items()))
    if name == "grammar":
        return None  # not a regex: see grammar.py
    if name == "regex":
        if not isinstance(value, str):
            raise ValueError(f"regex must be a string, got {type(value).__name__}")
        pattern = value
    elif name == "json_schema":
        pattern = schema_to_regex(value)
    else:
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"choices must be a non-empty list of non-empty strings, got {value!r}")
        pattern = "(?:" + "|".join(literal_pattern(choice) for choice in value) + ")"
    ByteDFA(pattern)  # parse now: a bad pattern fails when generate() starts
    return pattern


def vocabulary_bytes(tokenizer: Any) -> list[bytes | None]:
    """The bytes each token id adds to the text (None for special tokens, which constrained text never contains)."""
    vocabulary = tokenizer.get_vocab()
    size = max(vocabulary.values()) + 1
    special = set(getattr(tokenizer, "all_special_ids", []))
    # Added special tokens (chat markers such as <|im_end|>) that the tokenizer's special-token map may not list.
    special |= {i for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                if getattr(token, "special", False)}  # fmt: skip
    byte_level = _byte_decoder() if _is_byte_level(tokenizer) else None
    table: list[bytes | None] = [None] * size
    for piece, index in vocabulary.items():
        if index in special:
            continue
        if byte_level is not None:
            try:
                table[index] = bytes(byte_level[char] for char in piece)
            except KeyError:
                table[index] = piece.encode()
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte fallback
            table[index] = bytes([int(piece[3:5], 16)])
        else:
            table[index] = piece.replace("\u2581", " ").encode()
    return table


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in type(backend.decoder).__name__ + str(backend.decoder)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table (the inverse of what the ByteLevel pre-tokenizer emits)."""
    return {character: byte for byte, character in bytes_to_unicode().items()}


class _Trie:
    """Token byte strings sharing prefixes: node = (children by byte, token ids ending here)."""

    def __init__(self, pieces: list[bytes | None]) -> None:
        self.root: tuple[dict, list] = ({}, [])
        for index, piece in enumerate(pieces):
            if not piece:
                continue
            node = self.root
            for byte in piece:
                node = node[0].setdefault(byte, ({}, []))
            node[1].append(index)


class CompiledConstraint:
    """A pattern's DFA against one vocabulary, with the packed mask of every automaton state met so far. Shared by
    the generate() calls of the same (pattern, vocabulary, end-of-sequence ids): masks are built once."""

    def __init__(self, pattern: str, pieces: list[bytes | None], eos_token_ids: list[int], vocab_size: int) -> None:
        self.dfa = ByteDFA(pattern)
        self.eos = [i for i in eos_token_ids if i is not None]
        # An end-of-sequence token is never text, whatever its bytes: it is allowed only where the pattern is complete.
        self.pieces = [None if index in self.eos else piece for index, piece in enumerate(pieces)]
        pieces = self.pieces
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._trie = _Trie(pieces)
        # Every single byte a token: then each state the DFA keeps (all can still reach a match, byte by byte) can
        # reach it token by token too. Otherwise a branch may be a dead end for this vocabulary: _live prunes it.
        self._every_byte = len({piece for piece in pieces if piece is not None and len(piece) == 1}) == 256
        self._live_states: dict[int, bool] = {}
        self._row_of_state: dict[int, int] = {}
        self._packed: torch.Tensor | None = None  # [states seen, words] int32, on the device of the last use
        self._bits_of_byte: torch.Tensor | None = None
        self._unpacked: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def mask_row(self, state: int) -> int:
        """Row of ``state``'s packed mask (built on first use)."""
        row = self._row_of_state.get(state)
        if row is None:
            row = self._add_mask(state)
        return row

    def _add_mask(self, state: int) -> int:
        allowed = torch.zeros(self.words * 32, dtype=torch.bool)
        if state == _FINISHED:
            allowed[: self.vocab_size] = True
        elif state == ByteDFA.DEAD:
            raise ValueError("constrained decoding reached text outside the pattern (a token was forced by another "
                             "processor); the constraint cannot continue")  # fmt: skip
        else:
            tokens = self._allowed_tokens(state)
            if tokens:
                allowed[torch.tensor(tokens)] = True
            if self.dfa.accepts(state):
                allowed[self.eos] = True
            elif not tokens:
                raise ValueError(f"no token of the vocabulary can continue the pattern {self.dfa.pattern!r} here "
                                 f"(the text so far is a dead end for this tokenizer)")  # fmt: skip
        # 32 tokens per int32 word, token 32 w + i at bit i (little-endian bytes, as the unpacking table reads them).
        packed = (allowed.view(self.words, 32).to(torch.int64) << torch.arange(32)).sum(dim=1).to(torch.int32)[None]
        if self._packed is None:
            self._packed = packed
            self._bits_of_byte = (torch.arange(256)[:, None] >> torch.arange(8) & 1).bool()
        else:
            self._packed = torch.cat([self._packed, packed.to(self._packed.device)])
        self._row_of_state[state] = self._packed.shape[0] - 1
        return self._packed.shape[0] - 1

    def _allowed_tokens(self, state: int) -> list[int]:
        return [token for following, tokens in self._successors(state).items() if self._live(following)
                for token in tokens]  # fmt: skip

    def _successors(self, state: int) -> dict[int, list[int]]:
        """The states one token leads to from ``state`` (DEAD left out), each with its tokens."""
        found: dict[int, list[int]] = {}
        stack = [(self._trie.root, state)]
        step = self.dfa.step
        while stack:
            (children, _), at = stack.pop()
            for byte, child in children.items():
                following = step(at, byte)
                if following != ByteDFA.DEAD:
                    if child[1]:
                        found.setdefault(following, []).extend(child[1])
                    if child[0]:
                        stack.append((child, following))
        return found

    def _live(self, state: int) -> bool:
        """Whether some sequence of tokens leads from ``state`` to a match (always, when every byte is a token)."""
        if self._every_byte:
            return True
        known = self._live_states.get(state)
        if known is not None:
            return known
        seen, frontier = {state}, [state]
        while frontier:  # breadth-first over token steps, until a match or everything reachable is seen
            at = frontier.pop()
            if self.dfa.accepts(at) or self._live_states.get(at):
                self._live_states[state] = True
                return True
            for following in self._successors(at):
                if following not in seen and self._live_states.get(following) is not False:
                    seen.add(following)
                    frontier.append(following)
        for dead in seen:  # nothing reachable from any of them matches
            self._live_states[dead] = False
        return False

    def additive_mask(self, state: int, scores: torch.Tensor) -> torch.Tensor:
        """``state``'s mask as 0 / -inf in the dtype and on the device of ``scores`` [B, V] (one add applies it):
        unpacked from its packed row through a 256 x 8 table (each byte of the words gives its 8 tokens' flags) and
        kept for the most recently used states. Ids past the tokenizer's vocabulary (padded embeddings) are masked."""
        key = (state, str(scores.device), scores.dtype, scores.shape[-1])
        mask = self._unpacked.get(key)
        if mask is None:
            row = self.mask_row(state)
            packed, bits_of_byte = self.packed_on(scores.device)
            allowed = bits_of_byte[packed[row].view(torch.uint8).long()].view(-1)[: scores.shape[-1]]
            mask = torch.full((scores.shape[-1],), -float("inf"), dtype=scores.dtype, device=scores.device)
            mask[: allowed.shape[0]].masked_fill_(allowed, 0.0)
            self._unpacked[key] = mask
            if len(self._unpacked) > MAX_UNPACKED:
                self._unpacked.popitem(last=False)
        else:
            self._unpacked.move_to_end(key)
        return mask

    def packed_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed masks [states, words] int32 and the byte -> 8 flags table, on ``device``."""
        if self._packed.device != device:
            self._packed, self._bits_of_byte = self._packed.to(device), self._bits_of_byte.to(device)
        return self._packed, self._bits_of_byte


def compiled_constraint(pattern: str, tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> CompiledConstraint:
    """The shared CompiledConstraint of these arguments (the vocabulary's bytes are read once per tokenizer)."""
    return _compiled(pattern, tokenizer, tuple(eos_token_ids), vocab_size)


@functools.lru_cache(maxsize=16)
def _compiled(pattern: str, tokenizer: Any, eos_token_ids: tuple[int, ...], vocab_size: int) -> CompiledConstraint:
    return CompiledConstraint(pattern, _vocabulary_bytes_of(tokenizer), list(eos_token_ids), vocab_size)


@functools.lru_cache(maxsize=4)
def _vocabulary_bytes_of(tokenizer: Any) -> list[bytes | None]:
    return vocabulary_bytes(tokenizer)


def check_some_token_allowed(scores: torch.Tensor, rows: list[int]) -> None:
    """Fails when a constrained row has no token left: the constraint's allowed tokens were all masked by a logits
    processor before it (greedy would then pick id 0, sampling fail on NaN probabilities)."""
    if not rows:
        return
    dead = torch.isneginf(scores[rows]).all(dim=-1)
    if bool(dead.any()):
        row = rows[int(dead.nonzero()[0])]
        raise ValueError(
            f"row {row}: every token the constraint allows here was masked by another logits processor (typically "
            "min_new_tokens / min_length forbidding the end token once the constraint is complete, or "
            "suppress_tokens / bad_words_ids): lower min_new_tokens or let the pattern run longer"
        )


class RecentPrefixes:
    """A value per generated prefix (an automaton state, a grammar matcher), kept for the prefixes of the last
    KEEP_CALLS processor calls: memory linear in the output length (all prefixes ever seen would be quadratic), and a
    rolled-back speculative draft or a reordered beam still finds a recent ancestor to continue from."""

    KEEP_CALLS = 32

    def __init__(self, root: Any) -> None:
        self._values: dict[tuple[int, ...], tuple[Any, int]] = {(): (root, 0)}
        self._call = 0

    def longest(self, prefix: tuple[int, ...]) -> tuple[int, Any]:
        """(n, value) of the longest kept prefix ``prefix[:n]`` (the empty prefix always is)."""
        cut = len(prefix)
        while cut > 0 and prefix[:cut] not in self._values:
            cut -= 1
        return cut, self._values[prefix[:cut]][0]

    def record(self, prefixes: list[tuple[int, ...]], values: list[Any]) -> None:
        self._call += 1
        for prefix, value in zip(prefixes, values, strict=True):
            self._values[prefix] = (value, self._call)
        if self._call % self.KEEP_CALLS == 0:
            oldest = self._call - self.KEEP_CALLS
            self._values = {p: entry for p, entry in self._values.items() if entry[1] > oldest or not p}

    def __len__(self) -> int:
        return len(self._values)


class ConstrainedLogitsProcessor(LogitsProcessor):
    """Masks every token that would leave the pattern; end-of-sequence only where the text so far matches. One per
    generate() call (it records the prompt length and the states of recent prefixes: RecentPrefixes).

    A row generate() has stopped (an end token, stop_strings, a stopping criterion) is padded with ``pad_token_id``:
    a pad token the pattern cannot take ends the row instead of failing it."""

    def __init__(self, compiled: CompiledConstraint, pad_token_id: int | None = None) -> None:
        self.compiled, self.pad_token_id = compiled, pad_token_id
        self.states = RecentPrefixes(compiled.dfa.start)
        self.prompt_length: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        prefixes = [tuple(tokens) for tokens in input_ids[:, self.prompt_length :].tolist()]
        states = [self._state(prefix) for prefix in prefixes]
        self.states.record(prefixes, states)
        masks = [self.compiled.additive_mask(state, scores) for state in states]
        scores = scores + (masks[0] if len(masks) == 1 else torch.stack(masks))
        check_some_token_allowed(scores, [row for row, state in enumerate(states) if state != _FINISHED])
        return scores

    def _state(self, prefix: tuple[int, ...]) -> int:
        """The automaton state after ``prefix``: from its longest recent prefix, walking the tokens after it."""
        cut, state = self.states.longest(prefix)
        for token in prefix[cut:]:
            state = self._advance(state, token)
        return state

    def _advance(self, state: int, token: int) -> int:
        compiled = self.compiled
        if state == _FINISHED or token in compiled.eos:
            return _FINISHED
        piece = compiled.pieces[token] if token < len(compiled.pieces) else None
        following = compiled.dfa.walk(state, piece) if piece else ByteDFA.DEAD
        if following == ByteDFA.DEAD and token == self.pad_token_id:
            return _FINISHED  # generate() pads a row it stopped
        return following
