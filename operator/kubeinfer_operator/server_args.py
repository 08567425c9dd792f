"""spec.engine.extraArgs read the way the server's own argparse parser (server/cli.py) reads them, so
that a list the server would refuse (or act on and exit: `-h`) is refused at admission instead of
crash-looping the pods. The operator image does not carry the server package, so this module holds
what the parser knows about each flag the operator lets users pass: whether it takes a value, and the
value's kind and choices. tests/operator/test_op_server_args.py compares both ways, flag by flag and
on a corpus of argument lists, against `server.cli.build_parser`: a flag or a value rule added to the
server without this table fails there.

What argparse does that matters here: an argument that does not start with `-` and is not the value
of the preceding flag is a positional, and the server takes none (exit 2); `-h` prints help and exits
0; a switch (store_true / BooleanOptionalAction) given `=value` is an error; a value-taking flag at the
end, or followed by an argument that looks like an option (starts with `-` and is not a negative
number), has no value (exit 2); a value failing its type or choices is an error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# server/cli.py's _SIZE_UNITS (bytes, decimal and binary prefixes, case-insensitive).
_SIZE_UNITS = {
    **dict.fromkeys(("", "b"), 1),
    **dict.fromkeys(("k", "kb"), 10**3),
    **dict.fromkeys(("m", "mb"), 10**6),
    **dict.fromkeys(("g", "gb"), 10**9),
    **dict.fromkeys(("ki", "kib"), 2**10),
    **dict.fromkeys(("mi", "mib"), 2**20),
    **dict.fromkeys(("gi", "gib"), 2**30),
}
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")
# argparse's own test for "looks like a negative number" (when the parser has no such option strings).
_NEGATIVE_NUMBER_RE = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _int(text: str) -> int:
    return int(text)


def _positive_int(text: str) -> None:
    if int(text) < 1:
        raise ValueError("must be >= 1")


def _non_negative_int(text: str) -> None:
    if int(text) < 0:
        raise ValueError("must be >= 0")


def _float(text: str) -> None:
    float(text)


def _non_negative_float(text: str) -> None:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("must be >= 0")


def _size(text: str) -> None:
    m = _SIZE_RE.fullmatch(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError("not a size (bytes, or e.g. 512MiB, 2GiB)")
    if int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]) < 1:
        raise ValueError("size must be positive")


def _str_list(text: str) -> None:
    t = text.strip()
    if t.startswith("["):
        value = json.loads(t)
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError("not a list of non-empty strings")
        return
    if not [p for p in t.split(",") if p.strip()]:
        raise ValueError("empty list")


def _any(text: str) -> None:
    return None


# The value kinds, by the server parser's `type` callable (its __name__); test_op_server_args.py checks
# that each accepts exactly what the server's does on a corpus of values.
VALUE_CHECKS: dict[str, Callable[[str], object]] = {
    "int": _int,
    "_positive_int": _positive_int,
    "_non_negative_int": _non_negative_int,
    "float": _float,
    "_non_negative_float": _non_negative_float,
    "parse_size": _size,
    "parse_str_list": _str_list,
    "str": _any,
}


@dataclass(frozen=True)
class ServerFlag:
    """One flag of the server's parser: `value` is None for a switch, else the kind of its value (a
    VALUE_CHECKS key); `choices` the values argparse allows (empty: any that the kind accepts)."""

    value: str | None
    choices: tuple[str, ...] = ()


_SWITCH = ServerFlag(None)

# Every flag of server/cli.py's parser that the operator does not manage (spec.MANAGED_FLAGS), --help
# left out (it prints and exits, so the pod crash-loops). Sorted; admission.SERVER_FLAGS and the CRD's
# CEL list are its keys. Generated: python scripts/sync_server_flags.py (after adding a server flag).
SERVER_FLAG_TABLE: dict[str, ServerFlag] = {
    "--allow-credentials": _SWITCH,
    "--allow-special-tokens-in-content": _SWITCH,
    "--allowed-headers": ServerFlag("parse_str_list"),
    "--allowed-methods": ServerFlag("parse_str_list"),
    "--allowed-origins": ServerFlag("parse_str_list"),
    "--attention-backend": ServerFlag("str", ("auto", "cpu", "torch", "triton")),
    "--batch-wait-ms": ServerFlag("_non_negative_float"),
    "--block-size": ServerFlag("int", ("8", "16", "32", "64", "128")),
    "--burst-itl-factor": ServerFlag("float"),
    "--burst-itl-seconds": ServerFlag("_non_negative_float"),
    "--chat-template": ServerFlag("str"),
    "--device": ServerFlag("str"),
    "--distributed-timeout": ServerFlag("float"),
    "--enable-auto-tool-choice": _SWITCH,
    "--enable-responses-store": _SWITCH,
    "--kv-cache-dtype": ServerFlag("str", ("auto", "bfloat16", "float16", "float32", "int8")),
    "--kv-cache-memory": ServerFlag("parse_size"),
    "--limit-concurrency": ServerFlag("int"),
    "--limit-concurrency-per-client": ServerFlag("int"),
    "--log-level": ServerFlag("str", ("debug", "info", "warning", "error")),
    "--logprobs-mode": ServerFlag(
        "str", ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
    ),
    "--long-prefill-token-threshold": ServerFlag("_non_negative_int"),
    "--lora-allowed-paths": ServerFlag("parse_str_list"),
    "--max-best-of": ServerFlag("_positive_int"),
    "--max-input-tokens": ServerFlag("_positive_int"),
    "--max-lora-rank": ServerFlag("_positive_int"),
    "--max-num-batched-tokens": ServerFlag("_positive_int"),
    "--max-payload-bytes": ServerFlag("parse_size"),
    "--max-stop-sequences": ServerFlag("_positive_int"),
    "--max-top-n-tokens": ServerFlag("int"),
    "--no-allow-credentials": _SWITCH,
    "--no-allow-special-tokens-in-content": _SWITCH,
    "--no-enable-auto-tool-choice": _SWITCH,
    "--no-enable-responses-store": _SWITCH,
    "--no-ui": _SWITCH,
    "--num-kv-blocks": ServerFlag("_positive_int"),
    "--num-threads": ServerFlag("_positive_int"),
    "--pooling-step-tokens": ServerFlag("_non_negative_int"),
    "--prefill-itl-factor": ServerFlag("float"),
    "--prefill-itl-min-tokens": ServerFlag("_non_negative_int"),
    "--reasoning-parser": ServerFlag("str"),
    "--responses-store-max-bytes": ServerFlag("_positive_int"),
    "--responses-store-max-entries": ServerFlag("_positive_int"),
    "--responses-store-ttl": ServerFlag("_non_negative_float"),
    "--scheduling-policy": ServerFlag("str", ("fcfs", "priority")),
    "--thread-policy": ServerFlag("str", ("adaptive", "fixed")),
    "--timeout-request-body": ServerFlag("float"),
    "--timeout-request-head": ServerFlag("float"),
    "--tool-call-parser": ServerFlag(
        "str", ("hermes", "llama3_json", "granite", "phi4_mini_json", "pythonic", "openai")
    ),
    "--ui": _SWITCH,
}


def _value_error(flag: str, spec: ServerFlag, value: str) -> str | None:
    check = VALUE_CHECKS.get(spec.value or "str", _any)
    try:
        check(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        return f"{flag}: invalid value (a {spec.value.lstrip('_').replace('_', ' ')})"  # type: ignore[union-attr]
    if spec.choices and value not in spec.choices:
        return f"{flag}: invalid choice (choose from {', '.join(spec.choices)})"
    return None


def _looks_like_option(arg: str) -> bool:
    return arg.startswith("-") and not _NEGATIVE_NUMBER_RE.match(arg) and arg != "-"


def argument_errors(args: Iterable[str], known: dict[str, ServerFlag] | None = None) -> list[str]:
    """What the server's parser would refuse in `args` (a list as spec.engine.extraArgs holds it),
    beyond unknown `--` flags (admission.unknown_flags names those). Messages name flags, never
    values (a value may be a secret)."""
    table = SERVER_FLAG_TABLE if known is None else known
    items = list(args)
    errors: list[str] = []
    i = 0
    while i < len(items):
        arg = items[i]
        i += 1
        if not arg.startswith("--"):
            if arg.startswith("-") and not _NEGATIVE_NUMBER_RE.match(arg) and arg != "-":
                errors.append(f"{arg[:2]}: short options are not server flags (-h would print help and exit)")
            else:
                errors.append(f"entry {i}: a stray argument (the server takes no positional arguments)")
            continue
        flag, eq, value = arg.partition("=")
        spec = table.get(flag)
        if spec is None:
            continue  # an unknown flag: admission.unknown_flags reports it by name
        if spec.value is None:
            if eq:
                errors.append(f"{flag}: a switch takes no value")
            continue
        if not eq:
            if i >= len(items) or _looks_like_option(items[i]):
                errors.append(f"{flag}: expected one value")
                continue
            value = items[i]
            i += 1
        problem = _value_error(flag, spec, value)
        if problem:
            errors.append(problem)
    return errors
