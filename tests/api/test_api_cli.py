"""Flags, their environment variables, and ServerConfig validation (no server started)."""

from __future__ import annotations

import dataclasses

import pytest

from server.cli import build_parser, config_from_args, parse_size
from server.config import (
    CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    CPU_PREFILL_ITL_FACTOR,
    EngineConfig,
    ModelConfig,
    ServerConfig,
)


def _config(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    parser = build_parser(env or {})
    return config_from_args(parser.parse_args(argv))


def test_api_cli_defaults() -> None:
    c = _config([])
    assert c.port == 8080 and c.max_concurrent_requests == 128 and c.max_payload_bytes == 2_000_000
    assert c.api_key is None and c.log_format == "text" and c.engine.model.model is None
    assert c.engine.cache.enable_prefix_caching is True
    assert c.engine.cache.kv_cache_memory_bytes == 512 * 2**20


def test_api_cli_env_and_flag_precedence() -> None:
    env = {
        "MODEL_ID": "/models/x",
        "PORT": "9000",
        "MAX_CONCURRENT_REQUESTS": "7",
        "MAX_INPUT_TOKENS": "100",
        "MAX_TOTAL_TOKENS": "200",
        "API_KEY": "k",
        "QUANTIZE": "awq",
        "DTYPE": "bfloat16",
        "ENABLE_PREFIX_CACHING": "false",
        "KUBEINFER_KV_CACHE_MEMORY": "1GiB",
        "KUBEINFER_DRAIN_TIMEOUT": "5",
        "LOG_FORMAT": "json",
        "KUBEINFER_CACHE_DIR": "/cache",
        "PAYLOAD_LIMIT": "1MB",
    }
    c = _config([], env)
    assert c.engine.model.model == "/models/x" and c.port == 9000 and c.max_concurrent_requests == 7
    assert c.max_input_tokens == 100 and c.max_total_tokens == 200 and c.engine.model.max_model_len == 200
    assert c.api_key == "k" and c.engine.model.quantize == "awq" and c.engine.model.dtype == "bfloat16"
    assert c.engine.cache.enable_prefix_caching is False and c.engine.cache.kv_cache_memory_bytes == 2**30
    assert c.drain_timeout_s == 5.0 and c.log_format == "json" and str(c.engine.model.cache_dir) == "/cache"
    assert c.max_payload_bytes == 1_000_000
    # A flag on the command line wins over the environment.
    c = _config(["--port", "9100", "--enable-prefix-caching", "--max-concurrent-requests", "3"], env)
    assert c.port == 9100 and c.engine.cache.enable_prefix_caching is True and c.max_concurrent_requests == 3


def test_api_cli_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser({"PORT": "eighty"})
    with pytest.raises(SystemExit):
        build_parser({"DTYPE": "float8"})
    with pytest.raises(SystemExit):
        _config(["--log-format", "xml"])
    with pytest.raises(SystemExit):
        _config(["--max-concurrent-requests", "0"])


@pytest.mark.parametrize(
    ("text", "value"), [("123", 123), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5KiB", 1536)]
)
def test_api_cli_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_api_server_config_validation() -> None:
    c = ServerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.port = 1  # type: ignore[misc]
    for bad in (
        {"port": 70000},
        {"max_concurrent_requests": 0},
        {"max_input_tokens": 10, "max_total_tokens": 10},
        {"log_format": "xml"},
        {"api_key": ""},
        {"drain_timeout_s": -1},
        {"max_payload_bytes": 10},
    ):
        with pytest.raises(ValueError):
            ServerConfig(**bad)  # type: ignore[arg-type]


def test_api_cli_tool_flags() -> None:
    c = _config(["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", "/t.jinja"])
    assert c.enable_auto_tool_choice and c.tool_call_parser == "hermes"
    assert c.engine.model.chat_template == "/t.jinja"
    env = {"KUBEINFER_ENABLE_AUTO_TOOL_CHOICE": "true", "KUBEINFER_TOOL_CALL_PARSER": "llama3_json"}
    c = _config([], env)
    assert c.enable_auto_tool_choice and c.tool_call_parser == "llama3_json"
    assert not _config([]).enable_auto_tool_choice
    with pytest.raises(ValueError, match="tool_call_parser"):
        _config(["--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        _config(["--tool-call-parser", "mistral"])


def test_api_cli_logprobs_mode() -> None:
    assert _config([]).engine.model.logprobs_mode == "raw_logprobs"
    assert _config(["--logprobs-mode", "processed_logits"]).engine.model.logprobs_mode == "processed_logits"
    env = {"KUBEINFER_LOGPROBS_MODE": "raw_logits"}
    assert _config([], env).engine.model.logprobs_mode == "raw_logits"
    with pytest.raises(SystemExit):
        _config(["--logprobs-mode", "masked"])
    with pytest.raises(ValueError, match="logprobs_mode"):
        ModelConfig(logprobs_mode="masked")


def test_api_cli_prefill_share_cap_by_device() -> None:
    """--long-prefill-token-threshold unset: the CPU-measured cap on CPU, none on CUDA (vLLM's GPU
    default): a 128-token share on a GPU would only split every prompt arriving beside decodes into
    more steps. Set (flag or environment), it holds on every device, 0 included."""
    engine = _config([]).engine
    assert engine.long_prefill_token_threshold is None
    assert engine.long_prefill_threshold_for("cpu") == CPU_LONG_PREFILL_TOKEN_THRESHOLD == 128
    assert engine.long_prefill_threshold_for("cuda") == 0
    for argv, env, want in (
        (["--long-prefill-token-threshold", "64"], {}, 64),
        (["--long-prefill-token-threshold", "0"], {}, 0),
        ([], {"KUBEINFER_LONG_PREFILL_TOKEN_THRESHOLD": "256"}, 256),
        ([], {"KUBEINFER_LONG_PREFILL_TOKEN_THRESHOLD": "0"}, 0),
    ):
        engine = _config(argv, env).engine
        assert [engine.long_prefill_threshold_for(d) for d in ("cpu", "cuda")] == [want, want]
    with pytest.raises(SystemExit):
        _config(["--long-prefill-token-threshold", "-1"])
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_api_cli_scheduling_policy() -> None:
    """--scheduling-policy (vLLM's): fcfs by default, priority by flag or KUBEINFER_SCHEDULING_POLICY;
    anything else refused by the parser and by EngineConfig."""
    assert _config([]).engine.scheduling_policy == "fcfs"
    assert _config(["--scheduling-policy", "priority"]).engine.scheduling_policy == "priority"
    assert _config([], {"KUBEINFER_SCHEDULING_POLICY": "priority"}).engine.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        _config(["--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def test_api_cli_prefill_itl_factor() -> None:
    """--prefill-itl-factor (KUBEINFER_PREFILL_ITL_FACTOR) and --prefill-itl-min-tokens: by default on CPU
    the measured cap (factor 2) governs prompts of more uncached tokens than the token budget beside the fixed
    threshold, off on CUDA; 0 turns it off; a factor sizes the cap for that many decode-only steps,
    starting at the fixed CPU value; with min tokens 0 it replaces the threshold, and setting the
    threshold too is refused (server/core/prefill_cap.py)."""
    engine = _config([]).engine
    default = engine.prefill_cap_for("cpu")
    assert default is not None and default.itl_factor == CPU_PREFILL_ITL_FACTOR == 2.0
    assert default.min_prompt_tokens == engine.max_num_batched_tokens == 2048  # the token budget
    assert engine.prefill_cap_for("cuda") is None
    budget = _config(["--max-num-batched-tokens", "4096"]).engine.prefill_cap_for("cpu")
    assert budget is not None and budget.min_prompt_tokens == 4096
    assert _config(["--prefill-itl-factor", "0"]).engine.prefill_cap_for("cpu") is None
    cap = _config(["--prefill-itl-factor", "3"]).engine.prefill_cap_for("cpu")
    assert cap is not None and cap.itl_factor == 3.0 and cap.initial == CPU_LONG_PREFILL_TOKEN_THRESHOLD
    env = _config([], {"KUBEINFER_PREFILL_ITL_FACTOR": "2.5"}).engine.prefill_cap_for("cpu")
    assert env is not None and env.itl_factor == 2.5
    every = _config(["--prefill-itl-min-tokens", "0"]).engine.prefill_cap_for("cpu")
    assert every is not None and every.min_prompt_tokens == 0
    env = _config([], {"KUBEINFER_PREFILL_ITL_MIN_TOKENS": "4096"}).engine.prefill_cap_for("cpu")
    assert env is not None and env.min_prompt_tokens == 4096
    both = _config(["--prefill-itl-factor", "2", "--long-prefill-token-threshold", "64"]).engine
    assert both.long_prefill_threshold_for("cpu") == 64 and both.prefill_cap_for("cpu") is not None
    # min tokens 0 beside a fixed threshold: refused where the measured cap is on (CPU), nothing to refuse on
    # CUDA; with the factor given too, refused at once
    mixed = _config(["--prefill-itl-min-tokens", "0", "--long-prefill-token-threshold", "64"]).engine
    assert mixed.prefill_cap_for("cuda") is None
    with pytest.raises(ValueError, match="set one of them"):
        mixed.prefill_cap_for("cpu")
    with pytest.raises(ValueError, match="set one of them"):
        _config(
            [
                "--prefill-itl-factor",
                "2",
                "--prefill-itl-min-tokens",
                "0",
                "--long-prefill-token-threshold",
                "8",
            ]
        )
    # threshold 0 is "no cap beyond the budget": the device's measured cap steps aside too
    assert _config(["--long-prefill-token-threshold", "0"]).engine.prefill_cap_for("cpu") is None
    # min tokens with the cap turned off would do nothing: refused
    with pytest.raises(ValueError, match="prefill_itl_min_tokens"):
        _config(["--prefill-itl-factor", "0", "--prefill-itl-min-tokens", "512"])
    with pytest.raises(SystemExit):
        _config(["--prefill-itl-min-tokens", "-1"])


def test_api_cli_burst_itl_factor() -> None:
    """--burst-itl-factor (KUBEINFER_BURST_ITL_FACTOR): 16 by default (server/core/burst_bound.py); 0
    turns the bound off; 1 or less, or not finite, is refused naming the field."""
    default = _config([]).engine.burst_bound_config()
    assert default is not None and default.itl_factor == 16.0
    assert _config(["--burst-itl-factor", "0"]).engine.burst_bound_config() is None
    bound = _config(["--burst-itl-factor", "4"]).engine.burst_bound_config()
    assert bound is not None and bound.itl_factor == 4.0
    env = _config([], {"KUBEINFER_BURST_ITL_FACTOR": "6"}).engine.burst_bound_config()
    assert env is not None and env.itl_factor == 6.0
    for bad in ("1", "0.5", "nan", "inf"):
        with pytest.raises((SystemExit, ValueError), match="burst_itl_factor"):
            _config(["--burst-itl-factor", bad])


def test_api_cli_burst_itl_seconds() -> None:
    """--burst-itl-seconds (KUBEINFER_BURST_ITL_SECONDS): 0.5 s by default beside the factor; 0 = the
    factor alone; negative or not finite is refused."""
    default = _config([]).engine.burst_bound_config()
    assert default is not None and default.itl_seconds == 0.5
    off = _config(["--burst-itl-seconds", "0"]).engine.burst_bound_config()
    assert off is not None and off.itl_seconds == 0.0 and off.itl_factor == 16.0
    env = _config([], {"KUBEINFER_BURST_ITL_SECONDS": "1.5"}).engine.burst_bound_config()
    assert env is not None and env.itl_seconds == 1.5
    for bad in ("-1", "nan", "inf"):
        with pytest.raises((SystemExit, ValueError)):
            _config(["--burst-itl-seconds", bad])


def test_api_cli_pooling_step_tokens() -> None:
    """--pooling-step-tokens (KUBEINFER_POOLING_STEP_TOKENS): 512 by default, 0 = the whole budget,
    negative refused."""
    assert _config([]).engine.pooling_step_tokens == 512
    assert _config(["--pooling-step-tokens", "0"]).engine.pooling_step_tokens == 0
    assert _config([], {"KUBEINFER_POOLING_STEP_TOKENS": "1024"}).engine.pooling_step_tokens == 1024
    with pytest.raises((SystemExit, ValueError)):
        _config(["--pooling-step-tokens", "-1"])
