"""vLLM's LoRA flags and their environment variables."""

from __future__ import annotations

import pytest

from server.cli import build_parser, config_from_args
from server.config import LoRAModule


def test_lora_flags_both_module_forms() -> None:
    args = build_parser({}).parse_args(
        [
            "--enable-lora",
            "--lora-modules",
            "sql=/adapters/sql",
            '{"name": "chat", "path": "org/chat-lora", "base_model_name": "base"}',
            "--max-loras",
            "4",
            "--max-lora-rank",
            "64",
            "--max-cpu-loras",
            "8",
        ]
    )
    lora = config_from_args(args).engine.lora
    assert lora.enable_lora and lora.max_loras == 4 and lora.max_lora_rank == 64 and lora.cpu_capacity == 8
    assert lora.lora_modules == (
        LoRAModule("sql", "/adapters/sql"),
        LoRAModule("chat", "org/chat-lora", "base"),
    )
    assert not lora.allow_runtime_updating


def test_lora_flags_from_environment() -> None:
    env = {"ENABLE_LORA": "true", "LORA_MODULES": "a=/x b=/y", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    lora = config_from_args(build_parser(env).parse_args([])).engine.lora
    assert [m.name for m in lora.lora_modules] == ["a", "b"] and lora.allow_runtime_updating
    assert lora.cpu_capacity == 1  # default: --max-loras


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/x"], "need --enable-lora"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "duplicate LoRA module names"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "must be >= max_loras"),
    ],
)
def test_lora_flag_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(build_parser({}).parse_args(argv))


def test_bad_lora_module_entry(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["--enable-lora", "--lora-modules", "no-equals-sign"])
    assert "bad --lora-modules entry" in capsys.readouterr().err
