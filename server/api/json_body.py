"""A hostile-input-safe JSON body parser for every route that reads a body.

Python's `json.loads` turns three kinds of input into exceptions that are not `JSONDecodeError`
(and so, unhandled, into a 500 that also closes the keep-alive connection):
- deep nesting (`[[[[...`): `RecursionError` in the C scanner (at ~1000 levels), or later in pydantic;
- a huge integer literal: `ValueError` from Python's int-string conversion limit (4300 digits,
  `sys.get_int_max_str_digits`);
- a lone UTF-16 surrogate escape (`"\\ud800"`): parses, then every `str.encode` (the tokenizer, the
  logs) fails with `UnicodeEncodeError`. RFC 8259 section 8.2 leaves such strings' meaning undefined and
  I-JSON (RFC 7493 section 2.1) forbids them, so they are refused.

`parse_json_body` bounds nesting depth (`MAX_DEPTH`, checked on the raw bytes before the parser
recurses) and integer literal length (`MAX_INT_DIGITS`), and refuses lone surrogates in keys and
values; each is a `validation` APIError (TGI 422 / OpenAI 400, by route family).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import validation

# Deeper than any real request (a JSON schema in response_format or tools nests a few dozen levels at
# most), far below the interpreter's recursion limit (1000) for the parser and pydantic after it.
MAX_DEPTH = 128
# 2**64 has 20 digits; no field takes more than a 64-bit seed. Floats are parsed by `float`, which
# has no such limit (a long mantissa rounds, a large exponent gives inf, refused by the fields).
MAX_INT_DIGITS = 100

_BRACKETS = re.compile(rb'[\[\]{}"\\]')


class _NumberTooLong(ValueError):
    pass


def _parse_int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise _NumberTooLong(digits)
    return int(text)


def _nesting_depth(raw: bytes, limit: int) -> int:
    """The deepest bracket nesting of a JSON text outside strings, counted up to `limit` + 1 (a scan of
    the bracket, quote and backslash bytes only: no recursion, linear in their number)."""
    depth = deepest = 0
    in_string = False
    escaped_at = -2
    for m in _BRACKETS.finditer(raw):
        c, pos = m.group(), m.start()
        if in_string:
            if c == b"\\":
                if escaped_at != pos - 1:
                    escaped_at = pos
                else:
                    escaped_at = -2  # "\\\\": the second backslash is itself escaped
            elif c == b'"' and escaped_at != pos - 1:
                in_string = False
            continue
        if c == b'"':
            in_string = True
        elif c in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def _check_strings(value: Any) -> None:
    """Raises a validation error for a string (key or value) holding a lone surrogate; iterative."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise validation(
                    "malformed JSON body: a string holds a lone UTF-16 surrogate escape (e.g. \\ud800) "
                    "that is not valid Unicode"
                ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of a request body. Raises a validation APIError for malformed JSON, nesting
    deeper than MAX_DEPTH, an integer literal longer than MAX_INT_DIGITS digits, or a lone surrogate."""
    if _nesting_depth(raw, MAX_DEPTH) > MAX_DEPTH:
        raise validation(f"malformed JSON body: nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(raw, parse_int=_parse_int)
    except _NumberTooLong:
        raise validation(f"malformed JSON body: an integer longer than {MAX_INT_DIGITS} digits") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise validation(f"malformed JSON body: {e}") from None
    except (RecursionError, ValueError) as e:  # defence in depth: never a 500 for a body
        raise validation(f"malformed JSON body: {type(e).__name__}") from None
    _check_strings(value)
    return value
