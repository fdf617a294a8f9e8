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

from .regex_automaton import MAX_REPEAT, json_string_pattern, literal_pattern

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
        return "(?:" + "|".join(_json_literal(value) for value in schema["enum"]) + ")"
    for keyword in ("anyOf", "oneOf"):
        if keyword in schema:
            options = [_compile(option, f"{path}.{keyword}[{i}]") for i, option in enumerate(schema[keyword])]
            return "(?:" + "|".join(options) + ")"
    kind = schema.get("type")
    if isinstance(kind, list):
        return "(?:" + "|".join(_compile({**schema, "type": one}, path) for one in kind) + ")"
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


def _json_literal(value: Any) -> str:
    return literal_pattern(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _string(schema: dict, path: str) -> str:
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise SchemaError(f"json_schema at {path}: pattern with minLength / maxLength is not supported; put the "
                          "lengths in the pattern (e.g. [a-z]{5,})")  # fmt: skip
    if "pattern" in schema:  # the whole value matches it (anchored); '"', '\\' and control characters escaped
        return '"' + json_string_pattern(schema["pattern"]) + '"'
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if high is not None and high > MAX_REPEAT:
        raise SchemaError(f"json_schema at {path}: maxLength above {MAX_REPEAT} is not supported")
    if low > MAX_REPEAT:
        raise SchemaError(f"json_schema at {path}: minLength above {MAX_REPEAT} is not supported")
    count = "*" if (low, high) == (0, None) else f"{{{low},{'' if high is None else high}}}"
    return f'"{_STRING_CHAR}{count}"'


def _object(schema: dict, path: str) -> str:
    if schema.get("additionalProperties") not in (None, False):
        raise SchemaError(f"json_schema at {path}: additionalProperties must be false or absent")
    properties = schema.get("properties", {})
    required = schema.get("required", list(properties))
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
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if max(low, high or 0) > MAX_REPEAT:
        raise SchemaError(f"json_schema at {path}: minItems / maxItems above {MAX_REPEAT} are not supported")
    separator = "," + _SPACE
    if high == 0:
        return r"\[" + _SPACE + r"\]"
    rest_high = "" if high is None else str(high - 1)
    more = f"(?:{separator}{item}){{{max(low - 1, 0)},{rest_high}}}"
    items = item + more
    return r"\[" + _SPACE + (f"(?:{items})?" if low == 0 else items) + _SPACE + r"\]"
