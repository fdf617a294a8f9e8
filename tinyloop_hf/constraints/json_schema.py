"""JSON Schema -> a regex (regex_automaton syntax) matching the JSON texts the schema allows.

Supported: type string / integer / number / boolean / null / object / array (or a list of them), enum, const,
anyOf / oneOf, object properties (in the listed order; ``required`` ones always, others optional after the first
required one; no additional properties), array ``items`` with minItems / maxItems, string minLength / maxLength /
pattern (matched by the whole decoded value; where it allows '"', '\\' or a control character, the output writes
its JSON escape). Output is compact JSON with an optional space after ':' and ','. Other keywords ($ref, allOf, not,
patternProperties, if/then, ...) fail with the keyword's name.
"""

from __future__ import annotations

import json
from typing import Any

from .regex_automaton import MAX_REPEAT, RegexError, json_string_pattern, literal_pattern

_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_BOOLEAN = "(?:true|false)"
_NULL = "null"
_SPACE = " ?"
_KNOWN = {
    "type", "enum", "const", "anyOf", "oneOf", "properties", "required", "additionalProperties", "items", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "title", "description", "default", "examples", "$schema",
}  # fmt: skip


class SchemaError(ValueError):
    """A schema this compiler cannot serve: the message names the path and the keyword."""


def schema_to_regex(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise SchemaError(f"json_schema is not valid JSON: {error}") from None
    return _compile(schema, "$")


def _compile(schema: Any, path: str) -> str:
    if schema is True or schema == {}:
        raise SchemaError(f"json_schema at {path}: an unconstrained value (true / {{}}) is not supported; give a type")
    if not isinstance(schema, dict):
        raise SchemaError(f"json_schema at {path}: a schema must be an object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - _KNOWN)
    if unknown:
        raise SchemaError(f"json_schema at {path}: unsupported keyword(s) {unknown}")
    if "const" in schema:
        return _json_literal(schema["const"])
    if "enum" in schema:
        return "(?:" + "|".join(_json_literal(value) for value in _non_empty_list(schema, "enum", path)) + ")"
    for keyword in ("anyOf", "oneOf"):
        if keyword in schema:
            options = _non_empty_list(schema, keyword, path)
            compiled = [_compile(option, f"{path}.{keyword}[{i}]") for i, option in enumerate(options)]
            return "(?:" + "|".join(compiled) + ")"
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = _non_empty_list(schema, "type", path)
        return "(?:" + "|".join(_compile({**schema, "type": one}, path) for one in kinds) + ")"
    if kind == "string":
        return _string(schema, path)
    if kind == "integer":
        return _INTEGER
    if kind == "number":
        return _NUMBER
    if kind == "boolean":
        return _BOOLEAN
    if kind == "null":
        return _NULL
    if kind == "object":
        return _object(schema, path)
    if kind == "array":
        return _array(schema, path)
    raise SchemaError(f"json_schema at {path}: type must be one of string, integer, number, boolean, null, object, "
                      f"array, got {kind!r}")  # fmt: skip


def _non_empty_list(schema: dict, keyword: str, path: str) -> list:
    value = schema[keyword]
    if not isinstance(value, list) or not value:
        raise SchemaError(f"json_schema at {path}: {keyword} must be a non-empty list, got {value!r}")
    return value


def _count(schema: dict, keyword: str, path: str, default: int | None) -> int | None:
    """A length / count keyword: an integer in [0, MAX_REPEAT] (or ``default`` where absent)."""
    value = schema.get(keyword, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"json_schema at {path}: {keyword} must be an integer >= 0, got {value!r}")
    if value > MAX_REPEAT:
        raise SchemaError(f"json_schema at {path}: {keyword} above {MAX_REPEAT} is not supported")
    return value


def _bounds(schema: dict, low_keyword: str, high_keyword: str, path: str) -> tuple[int, int | None]:
    low, high = _count(schema, low_keyword, path, 0), _count(schema, high_keyword, path, None)
    if high is not None and low > high:
        raise SchemaError(f"json_schema at {path}: {low_keyword} {low} is above {high_keyword} {high}")
    return low, high


def _json_literal(value: Any) -> str:
    return literal_pattern(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _string(schema: dict, path: str) -> str:
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise SchemaError(f"json_schema at {path}: pattern with minLength / maxLength is not supported; put the "
                          "lengths in the pattern (e.g. [a-z]{5,})")  # fmt: skip
    if "pattern" in schema:  # the whole value matches it (anchored); '"', '\\' and control characters escaped
        pattern = schema["pattern"]
        if not isinstance(pattern, str):
            raise SchemaError(f"json_schema at {path}.pattern: must be a string, got {pattern!r}")
        # Schemas often anchor their patterns; the whole value matches here anyway, so ^ and $ at the ends are exact.
        if pattern.startswith("^"):
            pattern = pattern[1:]
        if pattern.endswith("$"):
            backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
            pattern = pattern[:-1] if backslashes % 2 == 0 else pattern  # "\\$" is a literal dollar
        try:
            return '"' + json_string_pattern(pattern) + '"'
        except RegexError as error:
            raise SchemaError(f"json_schema at {path}.pattern: {error}") from None
    low, high = _bounds(schema, "minLength", "maxLength", path)
    count = "*" if (low, high) == (0, None) else f"{{{low},{'' if high is None else high}}}"
    return f'"{_STRING_CHAR}{count}"'


def _object(schema: dict, path: str) -> str:
    if schema.get("additionalProperties") not in (None, False):
        raise SchemaError(f"json_schema at {path}: additionalProperties must be false or absent")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise SchemaError(f"json_schema at {path}: properties must be an object, got {type(properties).__name__}")
    required = schema.get("required", list(properties))
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise SchemaError(f"json_schema at {path}: required must be a list of property names, got {required!r}")
    missing = [name for name in required if name not in properties]
    if missing:
        raise SchemaError(f"json_schema at {path}: required names properties that are not defined: {missing}")
    body, seen_required = "", False
    for name, sub in properties.items():
        member = _json_literal(name) + ":" + _SPACE + _compile(sub, f"{path}.{name}")
        if name in required:
            body += ("," + _SPACE if seen_required else "") + member
            seen_required = True
        elif seen_required:
            body += "(?:," + _SPACE + member + ")?"
        else:
            raise SchemaError(f"json_schema at {path}: optional property {name!r} before the first required one is "
                              f"not supported; list required properties first")  # fmt: skip
    return r"\{" + _SPACE + body + _SPACE + r"\}"


def _array(schema: dict, path: str) -> str:
    if "items" not in schema:
        raise SchemaError(f"json_schema at {path}: arrays need items")
    item = _compile(schema["items"], f"{path}[]")
    low, high = _bounds(schema, "minItems", "maxItems", path)
    separator = "," + _SPACE
    if high == 0:
        return r"\[" + _SPACE + r"\]"
    rest_high = "" if high is None else str(high - 1)
    more = f"(?:{separator}{item}){{{max(low - 1, 0)},{rest_high}}}"
    items = item + more
    return r"\[" + _SPACE + (f"(?:{items})?" if low == 0 else items) + _SPACE + r"\]"
