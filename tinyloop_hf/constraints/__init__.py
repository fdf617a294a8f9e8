"""Constrained decoding: regex / JSON schema / choices -> byte-level automaton -> token masks (see constrained.py)."""

from .json_schema import SchemaError, schema_to_regex
from .regex_automaton import ByteDFA, RegexError, literal_pattern

__all__ = ["ByteDFA", "RegexError", "SchemaError", "literal_pattern", "schema_to_regex"]
