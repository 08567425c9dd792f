"""spec.engine.extraArgs is read as the server's own parser reads it (server_args.py): the table of
flags agrees with server/cli.py's parser flag by flag (arity, value kind, choices), and on a corpus of
argument lists admission refuses exactly what the parser refuses. Found on kube-apiserver 1.36:
`["-h"]` (the server prints help and exits 0) and `["--no-ui", "stray"]` (exit 2) were accepted and
the pods crash-looped."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools

import pytest
from kubeinfer_operator.admission import extra_args_errors
from kubeinfer_operator.server_args import SERVER_FLAG_TABLE, VALUE_CHECKS, argument_errors
from kubeinfer_operator.spec import MANAGED_FLAGS

from server.cli import build_parser


def _actions() -> dict[str, argparse.Action]:
    return {o: a for a in build_parser({})._actions for o in a.option_strings if o.startswith("--")}


def _server_accepts(args: list[str]) -> bool:
    """Whether the server's parser takes `args` and goes on to start (a SystemExit of any code, help's
    0 included, means the pod does not serve)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser({}).parse_args(args)
        except SystemExit:
            return False
    return True


def test_the_table_is_the_parsers() -> None:
    actions = _actions()
    assert set(SERVER_FLAG_TABLE) == set(actions) - MANAGED_FLAGS - {"--help"}
    assert list(SERVER_FLAG_TABLE) == sorted(SERVER_FLAG_TABLE)
    for flag, spec in SERVER_FLAG_TABLE.items():
        action = actions[flag]
        if action.nargs == 0:
            assert spec.value is None, flag
            continue
        assert action.nargs is None, (flag, action.nargs)  # exactly one value
        kind = getattr(action.type, "__name__", "str") if action.type is not None else "str"
        if kind == "_kv_cache_dtype":
            # a type function that checks its own choices (and refuses fp8 by name): held as choices
            from server.config import KV_CACHE_DTYPE_CHOICES

            assert (spec.value, spec.choices) == ("str", KV_CACHE_DTYPE_CHOICES), flag
            continue
        assert spec.value == kind and kind in VALUE_CHECKS, (flag, kind)
        assert spec.choices == tuple(str(c) for c in (action.choices or ())), flag


VALUES = ["1", "0", "-1", "32", "1.5", "-0.5", "abc", "", "512MiB", "2 GiB", "0.0001k", '["a","b"]', "[1]", "a,b", ",", "nan", "inf", "auto", "fp8", "bfloat16", "info", "fixed", "hermes", "raw_logits", "cpu"]  # fmt: skip


def _corpus() -> list[list[str]]:
    cases: list[list[str]] = [
        [],
        ["-h"],
        ["-v"],
        ["stray"],
        ["--no-ui", "stray"],
        ["--no-ui=1"],
        ["--block-size"],
        ["--block-size", "--no-ui"],
        ["--block-size", "-5"],
        ["--block-size", "32", "--no-ui"],
        ["--max-num-batched-tokens=4096", "--ui"],
        ["--chat-template", "-"],
        ["--device", "--"],
        ["-"],
    ]
    for flag, spec in SERVER_FLAG_TABLE.items():
        if spec.value is None:
            cases += [[flag], [f"{flag}=x"]]
            continue
        for value in VALUES:
            cases += [[flag, value], [f"{flag}={value}"]]
    return cases


@pytest.mark.parametrize("args", _corpus(), ids=lambda a: " ".join(a) or "empty")
def test_admission_refuses_exactly_what_the_server_refuses(args: list[str]) -> None:
    assert (argument_errors(args) == []) == _server_accepts(args), args
    if not _server_accepts(args):
        assert extra_args_errors(args), args  # the spec-level check reports it too


def test_refusals_name_the_flag_not_the_value() -> None:
    secret = "s3cr3t-value"
    errors = argument_errors(["--block-size", secret, "--no-ui", secret])
    assert errors and all(secret not in e for e in errors), errors
    assert any("--block-size" in e for e in errors)


def test_pairs_of_valid_entries_are_accepted() -> None:
    valid = [["--block-size", "32"], ["--no-ui"], ["--log-level=debug"], ["--num-threads", "2"]]
    for a, b in itertools.permutations(valid, 2):
        assert extra_args_errors(a + b) == [] and _server_accepts(a + b), a + b
