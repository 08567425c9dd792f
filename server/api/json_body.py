"""A hostile-input-safe JSON body parser for every route that reads a body.

Python's `json.loads` turns three kinds of input into exceptions that are not `JSONDecodeError`
(and so, unhandled, into a 500 that also closes the keep-alive connection):
- deep nesting (`[[[[...`): `RecursionError` in the C scanner (at ~1000 levels), or later in pydantic;
- a huge integer literal: `ValueError` from Python's int-string conversion limit (4300 digits,
  `sys.get_int_max_str_digits`);
- a lone UTF-16 surrogate escape (`"\\ud800"`): parses, then every `str.encode` (the tokenizer, the
  logs) fails with `UnicodeEncodeError`. RFC 8259 section 8.2 leaves such strings' meaning undefined and
  I-JSON (RFC 7493 section 2.1) forbids them, so they are refused.

`parse_json_body` bounds nesting depth (`MAX_DEPTH`: the C parser's RecursionError beyond ~1000
levels, an iterative walk of the parsed value below) and integer literal length (`MAX_INT_DIGITS`), and
refuses lone surrogates in keys and values; each is a `validation` APIError (TGI 422 / OpenAI 400, by
route family).
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

_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # raw UTF-8 cannot hold a surrogate, an escape can


class _NumberTooLong(ValueError):
    pass


def _parse_int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise _NumberTooLong(digits)
    return int(text)


def _check_tree(value: Any, max_depth: int, strings: bool) -> None:
    """Raises a validation error for nesting deeper than `max_depth` or, with `strings`, a string (key
    or value) holding a lone surrogate. Iterative: no recursion on hostile input."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            if depth > max_depth:
                raise validation(f"malformed JSON body: nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                if strings:
                    stack.extend((k, depth) for k in item)
                stack.extend((v, depth) for v in item.values())
            else:
                stack.extend((v, depth) for v in item)
        elif strings and isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise validation(
                    "malformed JSON body: a string holds a lone UTF-16 surrogate escape (e.g. \\ud800) "
                    "that is not valid Unicode"
                ) from None


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of a request body. Raises a validation APIError for malformed JSON, nesting
    deeper than MAX_DEPTH, an integer literal longer than MAX_INT_DIGITS digits, or a lone surrogate."""
    # The hook costs a Python call per integer: only when a long digit run (maybe inside a string) is there.
    long_digits = _LONG_DIGITS.search(raw) is not None
    try:
        value = json.loads(raw, parse_int=_parse_int) if long_digits else json.loads(raw)
    except _NumberTooLong:
        raise validation(f"malformed JSON body: an integer longer than {MAX_INT_DIGITS} digits") from None
    except RecursionError:  # the C parser's own guard, at ~1000 levels
        raise validation(f"malformed JSON body: nested deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise validation(f"malformed JSON body: {e}") from None
    except ValueError as e:  # defence in depth: never a 500 for a body
        raise validation(f"malformed JSON body: {type(e).__name__}") from None
    # The walk costs a Python step per node: only when the raw text could need it.
    deep = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
    strings = _SURROGATE_ESCAPE.search(raw) is not None
    if deep or strings:
        _check_tree(value, MAX_DEPTH, strings)
    return value
