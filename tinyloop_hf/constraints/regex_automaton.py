"""A byte-level regex engine for constrained decoding: pattern -> Thompson NFA over UTF-8 bytes -> DFA built lazily.

The whole generated text must match the pattern (anchored at both ends). Supported syntax: literals and
escapes (``\\d \\w \\s \\D \\W \\S \\n \\t \\r \\xHH \\. \\\\`` ...), ``.`` (any character but newline),
classes ``[a-z0-9_]`` and ``[^...]`` (ASCII ranges; other characters listed one by one), groups ``( )`` and
``(?: )``, alternation ``|``, quantifiers ``* + ? {m} {m,} {m,n}``. Non-ASCII text is matched as its UTF-8 bytes;
``.`` and negated classes accept any valid UTF-8 sequence of a character outside the class. Anything else (anchors
inside the pattern, lookaround, backreferences, lazy quantifiers) is rejected with the position and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_REPEAT = 256  # {m,n} bounds beyond this would blow up the NFA

ByteSet = frozenset[int]
_ASCII = range(128)
_DIGITS = frozenset(range(ord("0"), ord("9") + 1))
_WORD = _DIGITS | frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("A"), ord("Z") + 1)) | {ord("_")}
_SPACE = frozenset(b" \t\n\r\f\v")
# \d \w \s are ASCII-only; their negations \D \W \S are every other character, non-ASCII included (as in re).
_CLASS_ESCAPES = {"d": _DIGITS, "w": _WORD, "s": _SPACE}
_NEGATED_ESCAPES = {"D": _DIGITS, "W": _WORD, "S": _SPACE}
# Well-formed UTF-8 of a non-ASCII character (Unicode Table 3-7): byte ranges, lead byte first. No surrogates, no
# overlong forms, nothing past U+10FFFF.
_TAIL = range(0x80, 0xC0)
_UTF8_SEQUENCES = (
    (range(0xC2, 0xE0), _TAIL),
    (range(0xE0, 0xE1), range(0xA0, 0xC0), _TAIL),
    (range(0xE1, 0xED), _TAIL, _TAIL),
    (range(0xED, 0xEE), range(0x80, 0xA0), _TAIL),
    (range(0xEE, 0xF0), _TAIL, _TAIL),
    (range(0xF0, 0xF1), range(0x90, 0xC0), _TAIL, _TAIL),
    (range(0xF1, 0xF4), _TAIL, _TAIL, _TAIL),
    (range(0xF4, 0xF5), range(0x80, 0x90), _TAIL, _TAIL),
)
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


class RegexError(ValueError):
    """An unsupported or malformed pattern: the message names the position and the problem."""


# -- syntax tree ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Bytes:  # one byte from a set
    allowed: ByteSet


@dataclass(frozen=True)
class _AnyChar:  # one UTF-8 character whose ASCII part is limited to `ascii` (non-ASCII: any, unless excluded)
    ascii: ByteSet
    non_ascii: bool = True


@dataclass(frozen=True)
class _Concat:
    parts: tuple


@dataclass(frozen=True)
class _Alternation:
    options: tuple


@dataclass(frozen=True)
class _Repeat:
    node: object
    low: int
    high: int | None  # None: unbounded


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.pattern, self.position = pattern, 0

    def fail(self, problem: str) -> RegexError:
        return RegexError(f"regex {self.pattern!r}, position {self.position}: {problem}")

    def peek(self) -> str | None:
        return self.pattern[self.position] if self.position < len(self.pattern) else None

    def take(self) -> str:
        char = self.pattern[self.position]
        self.position += 1
        return char

    def parse(self) -> object:
        node = self.alternation()
        if self.position != len(self.pattern):
            raise self.fail("unbalanced ')'")
        return node

    def alternation(self) -> object:
        options = [self.concatenation()]
        while self.peek() == "|":
            self.take()
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else _Alternation(tuple(options))

    def concatenation(self) -> object:
        parts = []
        while self.peek() not in (None, "|", ")"):
            parts.append(self.quantified())
        return parts[0] if len(parts) == 1 else _Concat(tuple(parts))

    def quantified(self) -> object:
        node = self.atom()
        while self.peek() in ("*", "+", "?", "{"):
            start = self.position
            char = self.take()
            if char == "{":
                low, high = self.bounds(start)
            else:
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            if self.peek() in ("?", "+"):
                raise self.fail("lazy and possessive quantifiers are not supported (the match is anchored anyway)")
            node = _Repeat(node, low, high)
        return node

    def bounds(self, start: int) -> tuple[int, int | None]:
        end = self.pattern.find("}", self.position)
        if end < 0:
            raise self.fail("'{' without '}'")
        body = self.pattern[self.position : end]
        self.position = end + 1
        low_text, comma, high_text = body.partition(",")
        try:
            low = int(low_text)
            high = (int(high_text) if high_text else None) if comma else low
        except ValueError:
            self.position = start
            raise self.fail(f"bad repetition {{{body}}}") from None
        if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
            self.position = start
            raise self.fail(f"repetition {{{body}}} must have low <= high <= {MAX_REPEAT}")
        return low, high

    def atom(self) -> object:
        char = self.peek()
        if char is None:
            raise self.fail("pattern ends where an expression was expected")
        if char in "*+?{":
            raise self.fail(f"nothing to repeat before {char!r}")
        self.take()
        if char == "(":
            if self.pattern.startswith("?:", self.position):
                self.position += 2
            elif self.peek() == "?":
                raise self.fail("lookaround and named groups are not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("'(' without ')'")
            self.take()
            return node
        if char == "[":
            return self.character_class()
        if char == ".":
            return _AnyChar(frozenset(_ASCII) - {ord("\n")})
        if char in "^$":
            raise self.fail("anchors are implicit (the whole output must match); remove ^ and $")
        if char == "\\":
            return self.escape(in_class=False)
        return _literal(char)

    def escape(self, in_class: bool) -> object:
        if self.peek() is None:
            raise self.fail("pattern ends after '\\'")
        char = self.take()
        if char in _CLASS_ESCAPES:
            return _Bytes(_CLASS_ESCAPES[char])
        if char in _NEGATED_ESCAPES and not in_class:
            return _AnyChar(frozenset(_ASCII) - _NEGATED_ESCAPES[char])
        if char in _CHAR_ESCAPES:
            return _literal(_CHAR_ESCAPES[char])
        if char == "x":
            digits = self.pattern[self.position : self.position + 2]
            if len(digits) != 2 or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail("\\x needs two hex digits")
            self.position += 2
            return _literal(chr(int(digits, 16)))
        if char.isalnum():
            raise self.fail(f"unsupported escape \\{char}")
        return _literal(char)

    def character_class(self) -> object:
        negate = self.peek() == "^"
        if negate:
            self.take()
        ascii_bytes: set[int] = set()
        others: list[str] = []
        any_non_ascii = False  # \D, \W or \S in the class: every non-ASCII character
        first = True
        while True:
            char = self.peek()
            if char is None:
                raise self.fail("'[' without ']'")
            if char == "]" and not first:
                self.take()
                break
            first = False
            self.take()
            if char == "\\":
                if self.peek() in _CLASS_ESCAPES:  # \d, \w, ... inside a class
                    ascii_bytes |= _CLASS_ESCAPES[self.take()]
                    continue
                if self.peek() in _NEGATED_ESCAPES:
                    ascii_bytes |= frozenset(_ASCII) - _NEGATED_ESCAPES[self.take()]
                    any_non_ascii = True
                    continue
                char = _char_of(self.escape(in_class=True))
            if self.peek() == "-" and self.pattern[self.position + 1 : self.position + 2] not in ("]", ""):
                self.take()
                end = self.take()
                if end == "\\":
                    end = _char_of(self.escape(in_class=True))
                if ord(end) < ord(char):
                    raise self.fail(f"bad range {char}-{end}")
                if ord(end) >= 128:
                    raise self.fail("character ranges must be ASCII (list other characters one by one)")
                ascii_bytes |= set(range(ord(char), ord(end) + 1))
            elif ord(char) < 128:
                ascii_bytes.add(ord(char))
            else:
                others.append(char)
        if negate:
            if others:
                raise self.fail("negated classes may only list ASCII characters")
            if any_non_ascii:  # [^\S]: no non-ASCII character, so a set of ASCII bytes
                return _Bytes(frozenset(_ASCII) - frozenset(ascii_bytes))
            return _AnyChar(frozenset(_ASCII) - frozenset(ascii_bytes))
        if any_non_ascii:
            return _AnyChar(frozenset(ascii_bytes))
        options = [_Bytes(frozenset(ascii_bytes))] if ascii_bytes else []
        options += [_literal(char) for char in others]
        if not options:
            raise self.fail("empty character class")
        return options[0] if len(options) == 1 else _Alternation(tuple(options))


def _literal(char: str) -> object:
    data = char.encode()
    parts = tuple(_Bytes(frozenset({byte})) for byte in data)
    return parts[0] if len(parts) == 1 else _Concat(parts)


def _char_of(node: object) -> str:
    data = bytes(next(iter(part.allowed)) for part in (node.parts if isinstance(node, _Concat) else (node,)))
    return data.decode()


def literal_pattern(text: str) -> str:
    """``text`` escaped so that the pattern matches exactly it."""
    return "".join("\\" + char if char in r"\.^$*+?{}[]()|-/" else char for char in text)


# -- patterns inside JSON strings -----------------------------------------------------------------------------------

# Characters a JSON string must escape, with their escapes (RFC 8259: '"', '\\' and U+0000-U+001F).
_JSON_ESCAPES = {ord('"'): '\\"', ord("\\"): "\\\\", 8: "\\b", 12: "\\f", 10: "\\n", 13: "\\r", 9: "\\t"}
_JSON_ESCAPES |= {byte: f"\\u{byte:04x}" for byte in range(0x20) if byte not in _JSON_ESCAPES}


def json_string_pattern(pattern: str) -> str:
    """A pattern over JSON string *contents* whose matches are the JSON escapes of ``pattern``'s matches: where
    ``pattern`` allows '"', '\\' or a control character, the output writes its escape (\\", \\\\, \\n, \\u001f ...),
    so that a JSON schema's ``pattern`` can never close the string early or put a raw control character in it."""
    return _to_pattern(_json_escaped(_Parser(pattern).parse()))


def _json_escaped(node: object) -> object:
    if isinstance(node, (_Bytes, _AnyChar)):
        allowed = node.allowed if isinstance(node, _Bytes) else node.ascii
        special = sorted(allowed & _JSON_ESCAPES.keys())
        if not special:
            return node
        rest = allowed - frozenset(special)
        kept = _Bytes(rest) if isinstance(node, _Bytes) else _AnyChar(rest, node.non_ascii)
        escapes = [_Concat(tuple(_Bytes(frozenset({ord(c)})) for c in _JSON_ESCAPES[byte])) for byte in special]
        options = ([kept] if rest or isinstance(node, _AnyChar) else []) + escapes
        return options[0] if len(options) == 1 else _Alternation(tuple(options))
    if isinstance(node, _Concat):
        return _Concat(tuple(_json_escaped(part) for part in node.parts))
    if isinstance(node, _Alternation):
        return _Alternation(tuple(_json_escaped(option) for option in node.options))
    if isinstance(node, _Repeat):
        return _Repeat(_json_escaped(node.node), node.low, node.high)
    raise TypeError(node)


def _to_pattern(node: object) -> str:
    """The syntax tree as pattern text that parses back to it."""
    if isinstance(node, _Bytes):  # ASCII here: a non-ASCII character's bytes are a _Concat's single bytes
        (byte, *others) = sorted(node.allowed)
        if not others and 0x20 < byte < 0x7F:
            return literal_pattern(chr(byte))
        return "[" + "".join(f"\\x{byte:02x}" for byte in sorted(node.allowed)) + "]"
    if isinstance(node, _AnyChar):  # a negated class: the ASCII left out, any non-ASCII character
        if not node.non_ascii:
            raise TypeError("an ASCII-only character set has no pattern syntax")
        return "[^" + "".join(f"\\x{byte:02x}" for byte in sorted(frozenset(_ASCII) - node.ascii)) + "]"
    if isinstance(node, _Concat):  # runs of single non-ASCII bytes are UTF-8 characters: written as themselves
        text, run = "", b""
        for part in (*node.parts, None):
            if isinstance(part, _Bytes) and len(part.allowed) == 1 and min(part.allowed) >= 0x80:
                run += bytes(part.allowed)
                continue
            text += literal_pattern(run.decode()) if run else ""
            text, run = text + ("" if part is None else _to_pattern(part)), b""
        return text
    if isinstance(node, _Alternation):
        return "(?:" + "|".join(_to_pattern(option) for option in node.options) + ")"
    if isinstance(node, _Repeat):
        return f"(?:{_to_pattern(node.node)}){{{node.low},{'' if node.high is None else node.high}}}"
    raise TypeError(node)


# -- NFA ------------------------------------------------------------------------------------------------------------


@dataclass
class _Nfa:
    epsilon: list[list[int]] = field(default_factory=list)
    edges: list[list[tuple[ByteSet, int]]] = field(default_factory=list)

    def state(self) -> int:
        self.epsilon.append([])
        self.edges.append([])
        return len(self.epsilon) - 1

    def build(self, node: object, start: int) -> int:
        """Add ``node`` from ``start``; return its end state."""
        if isinstance(node, _Bytes):
            end = self.state()
            self.edges[start].append((node.allowed, end))
            return end
        if isinstance(node, _AnyChar):
            end = self.state()
            self.edges[start].append((node.ascii, end))
            if node.non_ascii:  # lead byte, then 1-3 continuation bytes
                for lead, *rest in _UTF8_SEQUENCES:
                    current = self.state()
                    self.edges[start].append((frozenset(lead), current))
                    for index, allowed in enumerate(rest):
                        following = end if index == len(rest) - 1 else self.state()
                        self.edges[current].append((frozenset(allowed), following))
                        current = following
            return end
        if isinstance(node, _Concat):
            for part in node.parts:
                start = self.build(part, start)
            return start
        if isinstance(node, _Alternation):
            end = self.state()
            for option in node.options:
                branch = self.state()
                self.epsilon[start].append(branch)
                self.epsilon[self.build(option, branch)].append(end)
            return end
        if isinstance(node, _Repeat):
            for _ in range(node.low):
                start = self.build(node.node, start)
            if node.high is None:
                loop = self.state()
                self.epsilon[start].append(loop)
                self.epsilon[self.build(node.node, loop)].append(loop)
                return loop
            end = self.state()
            self.epsilon[start].append(end)
            for _ in range(node.high - node.low):
                start = self.build(node.node, start)
                self.epsilon[start].append(end)
            return end
        raise TypeError(node)


# -- DFA, built on demand -------------------------------------------------------------------------------------------


class ByteDFA:
    """Anchored matcher over bytes. States are small ints; DEAD (-1) means no match is possible any more."""

    DEAD = -1

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        tree = _Parser(pattern).parse()
        self._nfa = _Nfa()
        begin = self._nfa.state()
        self._accept = self._nfa.build(tree, begin)
        self._sets: list[frozenset[int]] = []
        self._ids: dict[frozenset[int], int] = {}
        self._moves: list[dict[int, int]] = []
        self.start = self._intern(self._closure({begin}))

    def _closure(self, states: set[int]) -> frozenset[int]:
        stack, seen = list(states), set(states)
        while stack:
            for following in self._nfa.epsilon[stack.pop()]:
                if following not in seen:
                    seen.add(following)
                    stack.append(following)
        return frozenset(seen)

    def _intern(self, states: frozenset[int]) -> int:
        if not states:
            return self.DEAD
        if states not in self._ids:
            self._ids[states] = len(self._sets)
            self._sets.append(states)
            self._moves.append({})
        return self._ids[states]

    def step(self, state: int, byte: int) -> int:
        if state == self.DEAD:
            return self.DEAD
        moves = self._moves[state]
        if byte not in moves:
            targets = {end for nfa_state in self._sets[state] for allowed, end in self._nfa.edges[nfa_state]
                       if byte in allowed}  # fmt: skip
            moves[byte] = self._intern(self._closure(targets))
        return moves[byte]

    def walk(self, state: int, data: bytes) -> int:
        for byte in data:
            state = self.step(state, byte)
            if state == self.DEAD:
                break
        return state

    def accepts(self, state: int) -> bool:
        return state != self.DEAD and self._accept in self._sets[state]

    def can_continue(self, state: int) -> bool:
        """Whether some non-empty continuation stays alive (else only end-of-sequence fits)."""
        return state != self.DEAD and any(self._nfa.edges[nfa_state] for nfa_state in self._sets[state])

    def fullmatch(self, data: bytes) -> bool:
        return self.accepts(self.walk(self.start, data))
