"""The CPU runtime environment the server sets before torch loads, and that a user's choice wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server.cpu_env import DEFAULTS, configure_cpu_runtime

KEYS = ("OMP_WAIT_POLICY", *DEFAULTS)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_defaults_fill_an_empty_environment(clean_env: pytest.MonkeyPatch) -> None:
    configure_cpu_runtime()
    assert {k: os.environ[k] for k in DEFAULTS} == DEFAULTS


def test_a_user_wait_policy_suppresses_the_spin_count(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OMP_WAIT_POLICY", "PASSIVE")
    clean_env.setenv("LRU_CACHE_CAPACITY", "7")
    configure_cpu_runtime()
    assert "GOMP_SPINCOUNT" not in os.environ
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == DEFAULTS["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]


def test_importing_any_server_module_applies_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    code = (
        "import sys, os; import server.engine; "
        "assert 'torch' in sys.modules; print(os.environ['GOMP_SPINCOUNT'], os.environ['LRU_CACHE_CAPACITY'])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [DEFAULTS["GOMP_SPINCOUNT"], DEFAULTS["LRU_CACHE_CAPACITY"]]
