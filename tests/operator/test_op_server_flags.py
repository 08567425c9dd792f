"""The operator's list of server flags (admission.SERVER_FLAGS, and the CRD's CEL copy) is the server's
own parser's, minus the flags the operator manages (issue 25 item 3): a flag added to server/cli.py
or to MANAGED_FLAGS without the other fails here, not as a crash-looping pod."""

from __future__ import annotations

import argparse
import re

import crd_cost
from kubeinfer_operator.admission import (
    SERVER_ENV,
    SERVER_FLAGS,
    UNKNOWN_FLAG_MESSAGE,
    extra_args_errors,
    refused_env_name,
)
from kubeinfer_operator.spec import MANAGED_FLAGS
from op_testlib import crd_schema

from server.cli import build_parser


def _parser_flags() -> set[str]:
    parser = build_parser({})
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


def test_server_flags_are_the_parsers_minus_the_managed_ones() -> None:
    flags = _parser_flags()
    assert flags >= MANAGED_FLAGS, MANAGED_FLAGS - flags  # a managed flag the server lost
    assert set(SERVER_FLAGS) == flags - MANAGED_FLAGS - {"--help"}
    assert list(SERVER_FLAGS) == sorted(SERVER_FLAGS)


def test_every_negation_of_a_managed_switch_is_managed() -> None:
    parser = build_parser({})
    for action in parser._actions:
        if isinstance(action, argparse.BooleanOptionalAction) and set(action.option_strings) & MANAGED_FLAGS:
            assert set(action.option_strings) <= MANAGED_FLAGS, action.option_strings


def test_the_crd_rule_lists_the_server_flags() -> None:
    (rule,) = [
        r.rule for r in crd_cost.rule_costs(crd_schema()) if r.message.startswith(UNKNOWN_FLAG_MESSAGE[:40])
    ]
    listed = rule.split("[", 1)[1].split("]", 1)[0]
    assert [f.strip().strip("'") for f in listed.split(",")] == list(SERVER_FLAGS)


def test_every_listed_flag_parses_and_an_unlisted_one_does_not() -> None:
    # What admission accepts, the server's parser accepts (values are separate arguments or after =).
    parser = build_parser({})
    args = ["--block-size", "32", "--max-num-batched-tokens=4096", "--no-ui"]
    assert extra_args_errors(args) == []
    parser.parse_args(args)
    for bad in (["--seed=1"], ["--mod=x"], ["--trust-remote-code"]):
        errors = extra_args_errors(bad)
        assert any(e.startswith(UNKNOWN_FLAG_MESSAGE) and bad[0].split("=")[0] in e for e in errors), errors


def test_the_generated_copies_are_current() -> None:
    """scripts/sync_server_flags.py regenerates the table and the CRD lists: run it after adding a flag."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "sync_server_flags.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_refused_env_is_every_variable_the_parser_reads() -> None:
    """Issue 45 item 1: a server flag's variable in pod.env would bypass the engine.extraArgs checks
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING, LORA_ALLOWED_PATHS); the operator's list is the parser's."""
    parser = build_parser({})
    read = {m for a in parser._actions for m in re.findall(r"\[env: ([A-Z0-9_]+)\]", a.help or "")}
    assert read and set(SERVER_ENV) == read
    assert list(SERVER_ENV) == sorted(SERVER_ENV)
    assert all(refused_env_name(n) for n in read)
    (rule,) = [
        r.rule
        for r in crd_cost.rule_costs(crd_schema())
        if r.message.startswith("pod.env must not set a variable that changes")
    ]
    assert all(f"'{n}'" in rule for n in read)
