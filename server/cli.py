"""`python -m server` / `kubeinfer-server`: flags, their environment variables, logging, then serve.

Every flag also reads an environment variable (TGI's names where TGI has the setting, else
KUBEINFER_*); a flag given on the command line wins over the environment. The bind address reads
KUBEINFER_HOST, not TGI's HOSTNAME: Docker and Kubernetes export HOSTNAME as the container's name,
and binding to it would shut out `kubectl port-forward` and in-pod probes on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from server.config import (
    ATTENTION_BACKENDS,
    BURST_ITL_FACTOR,
    BURST_ITL_SECONDS,
    CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    CPU_PREFILL_ITL_FACTOR,
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    KV_CACHE_FP8_NAMES,
    LOG_FORMATS,
    LOGPROBS_MODES,
    POOLING_STEP_TOKENS,
    QUANTIZE_CHOICES,
    TASK_CHOICES,
    THREAD_POLICIES,
    TOOL_CALL_PARSERS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    LoRAModule,
    ModelConfig,
    ParallelConfig,
    ResponsesStoreConfig,
    ServerConfig,
)
from server.core.request_queue import SCHEDULING_POLICIES
from server.spec_decode.config import parse_speculative_config

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
}


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '1.5GiB', '500MB'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 512MiB, 2GiB)")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def parse_objective_priorities(text: str) -> tuple[tuple[str, int], ...]:
    """`--objective-priority`: NAME=PRIORITY pairs (a JSON list or comma-separated) -> ((name, priority),
    ...). Raises argparse.ArgumentTypeError on a pair without `=`, an empty or repeated name, or a
    priority that is not an integer."""
    pairs: list[tuple[str, int]] = []
    for item in parse_str_list(text):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected NAME=PRIORITY, got {item!r}")
        try:
            priority = int(value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"priority of {name!r} must be an integer, got {value!r}"
            ) from None
        if any(name == n for n, _ in pairs):
            raise argparse.ArgumentTypeError(f"objective {name!r} given twice")
        pairs.append((name, priority))
    return tuple(pairs)


def parse_str_list(text: str) -> tuple[str, ...]:
    """A list of strings from a JSON list (vLLM's form, '["http://a", "http://b"]') or 'a,b'."""
    t = text.strip()
    if t.startswith("["):
        try:
            value = json.loads(t)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({e})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise argparse.ArgumentTypeError(f"not a list of non-empty strings: {text!r}")
        return tuple(value)
    items = tuple(p.strip() for p in t.split(",") if p.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"empty list: {text!r}")
    return items


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    try:
        if text.startswith("{"):
            obj = json.loads(text)
            if not isinstance(obj, dict) or set(obj) - {"name", "path", "base_model_name"}:
                raise ValueError("expected keys name, path and optionally base_model_name")
            return LoRAModule(
                str(obj.get("name") or ""), str(obj.get("path") or ""), obj.get("base_model_name")
            )
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError("expected name=path or a JSON object")
        return LoRAModule(name.strip(), path.strip())
    except (ValueError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"bad --lora-modules entry {text!r}: {e}") from None


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    env = dict(os.environ if environ is None else environ)
    parser = argparse.ArgumentParser(
        prog="kubeinfer-server",
        description="LLM inference server speaking the TGI and OpenAI wire formats. "
        "Each flag can also be set through the environment variable shown.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def add(
        flag: str, env_name: str, help: str, type: Callable[[str], Any] = str, default: Any = None, **kw: Any
    ) -> None:
        value = default
        if env_name in env and env[env_name] != "":
            try:
                value = type(env[env_name])
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"environment variable {env_name}={env[env_name]!r}: {e}")
            if "choices" in kw and value not in kw["choices"]:
                parser.error(f"environment variable {env_name}={value!r}: choose from {kw['choices']}")
        parser.add_argument(flag, type=type, default=value, help=f"{help} [env: {env_name}]", **kw)

    def add_bool(flag: str, env_name: str, help: str, default: bool, target: Any = parser) -> None:
        """--flag / --no-flag, its default read from env_name when set (true/false, 1/0, yes/no)."""
        value = default
        if env.get(env_name):
            try:
                value = parse_bool(env[env_name])
            except argparse.ArgumentTypeError as e:
                parser.error(f"environment variable {env_name}: {e}")
        target.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=value, help=f"{help} [env: {env_name}]"
        )

    g = parser.add_argument_group("model")
    add(
        "--model",
        "MODEL_ID",
        "Hugging Face folder or .gguf file; omitted = the embedded SmolLM2-135M-Instruct",
    )
    add(
        "--served-model-name",
        "SERVED_MODEL_NAME",
        "Model name reported by the APIs and metrics (default: the model id)",
    )
    add(
        "--dtype",
        "DTYPE",
        "Weight and activation dtype (auto: bf16 on GPUs and on CPUs with native bf16, else fp32; a "
        "quantized model on CPU (a GGUF is served quantized only under auto) keeps fp32 activations around "
        "its quantized GEMMs, which run in bf16 where the CPU has native bf16 and take int8 activations "
        "where it has not but AVX512-VNNI or AVX2 int8 kernels run: /info gemm_dtype)",
        default="auto",
        choices=DTYPE_CHOICES,
    )
    add(
        "--quantize",
        "QUANTIZE",
        "Quantization applied at load (or detected from the checkpoint)",
        choices=QUANTIZE_CHOICES,
    )
    add(
        "--cache-dir",
        "KUBEINFER_CACHE_DIR",
        "Folder for converted weights and built CPU kernels (default ~/.cache/kubeinfer)",
        type=Path,
    )
    add(
        "--task",
        "KUBEINFER_TASK",
        "What the model serves: generate, embed (/v1/embeddings, /embed) or score (/score, /rerank, "
        "/classify); auto reads config.json's architectures",
        default="auto",
        choices=TASK_CHOICES,
    )
    del g

    add("--host", "KUBEINFER_HOST", "Address to bind", default="0.0.0.0")
    add("--port", "PORT", "Port to listen on", type=int, default=8080)

    add(
        "--max-concurrent-requests",
        "MAX_CONCURRENT_REQUESTS",
        "Requests in flight beyond this get 429 at once (no waiting queue in front of the engine)",
        type=_positive_int,
        default=128,
    )
    add(
        "--max-input-tokens",
        "MAX_INPUT_TOKENS",
        "Longest prompt accepted, in tokens (default: max total - 1)",
        type=_positive_int,
    )
    add(
        "--max-total-tokens",
        "MAX_TOTAL_TOKENS",
        "Longest prompt + max_new_tokens accepted, in tokens; also the engine's context length "
        "(default: the model's, at most 8192)",
        type=_positive_int,
    )
    add("--max-best-of", "MAX_BEST_OF", "Largest TGI best_of accepted", type=_positive_int, default=2)
    add(
        "--max-stop-sequences",
        "MAX_STOP_SEQUENCES",
        "Most stop sequences per TGI request",
        type=_positive_int,
        default=4,
    )
    add("--max-top-n-tokens", "MAX_TOP_N_TOKENS", "Largest TGI top_n_tokens accepted", type=int, default=5)
    add(
        "--max-payload-bytes",
        "PAYLOAD_LIMIT",
        "Largest request body in bytes (or e.g. 2MB); larger gets 413",
        type=parse_size,
        default=2_000_000,
    )

    add(
        "--max-num-batched-tokens",
        "KUBEINFER_MAX_NUM_BATCHED_TOKENS",
        "Token budget of one engine step",
        type=_positive_int,
        default=2048,
    )
    add(
        "--long-prefill-token-threshold",
        "KUBEINFER_LONG_PREFILL_TOKEN_THRESHOLD",
        "While sequences are decoding, most prompt tokens in one engine step (bounds inter-token "
        "latency when prompts arrive; 0 = no cap beyond --max-num-batched-tokens). Default: "
        f"{CPU_LONG_PREFILL_TOKEN_THRESHOLD} on CPU, 0 on CUDA",
        type=_non_negative_int,
        default=None,
    )
    add(
        "--prefill-itl-factor",
        "KUBEINFER_PREFILL_ITL_FACTOR",
        "Size the chunks of a long prompt (--prefill-itl-min-tokens) beside decoding sequences from "
        "measured step costs, so that such a step costs at most this many times a decode-only step (their "
        "inter-token latency while the long prompt prefills; smaller chunks delay its first token). "
        f"0 = off (every prompt under --long-prefill-token-threshold). Default: {CPU_PREFILL_ITL_FACTOR:g} "
        "on CPU (0 where --long-prefill-token-threshold is 0), 0 on CUDA",
        type=float,
        default=None,
    )
    add(
        "--prefill-itl-min-tokens",
        "KUBEINFER_PREFILL_ITL_MIN_TOKENS",
        "Prompts with more uncached tokens than this are long: --prefill-itl-factor sizes their chunks; "
        "shorter ones keep --long-prefill-token-threshold. Default: --max-num-batched-tokens (a prompt "
        "that needs several steps even alone). 0 = every prompt (the measured cap replaces the threshold; "
        "not with --long-prefill-token-threshold)",
        type=_non_negative_int,
        default=None,
    )
    add(
        "--burst-itl-factor",
        "KUBEINFER_BURST_ITL_FACTOR",
        "While at least as many queued prompts can be admitted as sequences decode (a burst), a step "
        "admits prompts up to this many times the measured cost of a decode-only step of those "
        "sequences (their inter-token latency; never fewer tokens than the prefill cap). 0 = off: a "
        f"burst step may fill --max-num-batched-tokens (default {BURST_ITL_FACTOR:g})",
        type=float,
        default=BURST_ITL_FACTOR,
    )
    add(
        "--burst-itl-seconds",
        "KUBEINFER_BURST_ITL_SECONDS",
        "With --burst-itl-factor: a burst step also costs at most this many seconds by the measured step "
        "costs (the running sequences' inter-token latency while a burst is admitted; never fewer tokens "
        f"than the prefill cap). 0 = the factor alone (default {BURST_ITL_SECONDS:g})",
        type=_non_negative_float,
        default=BURST_ITL_SECONDS,
    )
    add(
        "--pooling-step-tokens",
        "KUBEINFER_POOLING_STEP_TOKENS",
        "A pooling model's (embed, score) engine step takes waiting inputs whole, in arrival order, while "
        "they fit this many tokens (an input longer than that runs alone): vLLM's "
        "max_num_batched_tokens for a pooling model, where ours must stay at the model's context so a "
        "longest input fits a step. Smaller steps answer the first of many concurrent requests sooner. "
        f"0 = the whole budget (default {POOLING_STEP_TOKENS})",
        type=_non_negative_int,
        default=POOLING_STEP_TOKENS,
    )
    add(
        "--scheduling-policy",
        "KUBEINFER_SCHEDULING_POLICY",
        "Order of waiting requests (vLLM's): fcfs, or priority (the request's `priority` field, lower "
        "first, FCFS within a level; a better level preempts running requests of a worse one when seats "
        "or KV blocks run out, and a worse level waits as long as better ones keep the engine full)",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
    )
    add(
        "--objective-priority",
        "KUBEINFER_OBJECTIVE_PRIORITY",
        "Gateway API Inference Extension objectives as NAME=PRIORITY pairs (JSON list or comma-separated): "
        "a chat or completions request whose x-gateway-inference-objective header names one, and whose "
        "body sets no `priority`, is scheduled at that priority (lower first; needs --scheduling-policy "
        "priority). The operator sets it from spec.routing.gateway.priority",
        type=parse_objective_priorities,
        default=(),
    )
    add(
        "--max-num-seqs",
        "KUBEINFER_MAX_NUM_SEQS",
        "Most sequences running in one batch",
        type=_positive_int,
        default=64,
    )
    add(
        "--block-size",
        "KUBEINFER_BLOCK_SIZE",
        "KV cache block size in tokens",
        type=int,
        default=16,
        choices=(8, 16, 32, 64, 128),
    )
    add(
        "--num-kv-blocks",
        "KUBEINFER_NUM_KV_BLOCKS",
        "KV cache blocks (overrides --kv-cache-memory)",
        type=_positive_int,
    )
    add(
        "--kv-cache-memory",
        "KUBEINFER_KV_CACHE_MEMORY",
        "KV cache memory budget, bytes or e.g. 512MiB",
        type=parse_size,
        default=512 * 2**20,
    )
    add(
        "--kv-cache-dtype",
        "KUBEINFER_KV_CACHE_DTYPE",
        "KV cache element type (vLLM's flag). auto: bfloat16 where --dtype resolves to bf16 compute (CPUs "
        "with native bf16, as for the GEMMs), else the model's dtype; float16 is llama.cpp's default; "
        "float32 is extra to vLLM's list; int8 (CPU, head_dim a multiple of 32) stores K/V as int8 with "
        "an fp32 scale per 32 values (llama.cpp's q8_0 cache type), 0.56x a bf16 cache's bytes; vLLM's fp8 "
        "types are refused. Attention computes in fp32 over a bf16/fp16/int8 cache, which holds 2x "
        "(int8: 3.56x) the tokens of an fp32 one in the same memory",
        type=_kv_cache_dtype,
        default="auto",
    )
    add_bool(
        "--enable-prefix-caching", "ENABLE_PREFIX_CACHING", "Reuse KV blocks of shared prompt prefixes", True
    )
    add(
        "--kv-events-config",
        "KUBEINFER_KV_EVENTS_CONFIG",
        'vLLM\'s KV-cache events as JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\' '
        "(for vllm-router --policy kv_aware; off by default)",
        type=_kv_events_config,
    )
    add(
        "--attention-backend",
        "KUBEINFER_ATTENTION_BACKEND",
        "Attention implementation (auto: triton on CUDA; on CPU, cpu = torch plus a compiled decode kernel "
        "built at first start, or torch when no C++ compiler is found)",
        default="auto",
        choices=ATTENTION_BACKENDS,
    )
    add("--device", "KUBEINFER_DEVICE", "auto, cpu, cuda or cuda:N", default="auto")
    add(
        "--num-threads",
        "KUBEINFER_NUM_THREADS",
        "torch intra-op threads on CPU (default: torch's)",
        type=_positive_int,
    )
    add(
        "--thread-policy",
        "KUBEINFER_THREAD_POLICY",
        "adaptive: each CPU step runs with the thread count (1 up to --num-threads) measured fastest for steps "
        "of its size, so cores shared with other processes do not stall every OpenMP barrier; fixed: always "
        "--num-threads (results then never depend on the load)",
        choices=THREAD_POLICIES,
        default="adaptive",
    )
    add(
        "--batch-wait-ms",
        "KUBEINFER_BATCH_WAIT_MS",
        "When the engine is idle, the first step waits until no request arrived for this long (at most 8 "
        "times it in all), so requests arriving together start together instead of later ones being "
        "prefilled beside the first one's decoding (0 = step at once)",
        type=_non_negative_float,
        default=5.0,
    )
    add(
        "--speculative-config",
        "KUBEINFER_SPECULATIVE_CONFIG",
        "Speculative decoding, as JSON with vLLM's keys, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' or, with a draft model '
        'of the same tokenizer, \'{"model": "PATH_OR_HUB_ID", "num_speculative_tokens": 3}\' (default: off)',
    )

    add(
        "--chat-template",
        "KUBEINFER_CHAT_TEMPLATE",
        "Jinja chat template file replacing the model's (the embedded SmolLM2 uses the shipped "
        "tool-aware server/templates/smollm2_tools.jinja)",
    )
    add(
        "--logprobs-mode",
        "KUBEINFER_LOGPROBS_MODE",
        "What returned logprobs report, as vLLM: raw_logprobs (the model's own distribution, before "
        "penalties, a grammar's mask, temperature and top-k/top-p), raw_logits, processed_logprobs or "
        "processed_logits (after all of them; tokens they exclude are left out of top lists)",
        default="raw_logprobs",
        choices=LOGPROBS_MODES,
    )
    add_bool(
        "--allow-special-tokens-in-content",
        "KUBEINFER_ALLOW_SPECIAL_TOKENS_IN_CONTENT",
        "Parse special-token strings typed inside chat messages (e.g. <|im_start|>) as control tokens; "
        "by default they are text, so a user cannot forge turns (raw completion prompts and TGI "
        "inputs are always parsed)",
        False,
    )
    add_bool(
        "--enable-auto-tool-choice",
        "KUBEINFER_ENABLE_AUTO_TOOL_CHOICE",
        'Allow tool_choice "auto": the model decides, --tool-call-parser reads its calls',
        False,
    )
    add(
        "--tool-call-parser",
        "KUBEINFER_TOOL_CALL_PARSER",
        "How tool calls are read from the model's text with tool_choice auto (vLLM's names)",
        choices=TOOL_CALL_PARSERS,
    )
    add(
        "--reasoning-parser",
        "KUBEINFER_REASONING_PARSER",
        "Split the model's thinking from its answer (vLLM's names: deepseek_r1, qwen3, openai_gptoss for "
        "gpt-oss's harmony channels): "
        "reasoning_content on chat completions, reasoning items on /v1/responses",
    )
    add_bool(
        "--enable-responses-store",
        "KUBEINFER_ENABLE_RESPONSES_STORE",
        "Keep /v1/responses results in memory (per API key, this replica only) for previous_response_id "
        "and GET /v1/responses/{id}",
        True,
    )
    add(
        "--responses-store-max-entries",
        "KUBEINFER_RESPONSES_STORE_MAX_ENTRIES",
        "Stored responses kept at most (least recently used evicted)",
        type=_positive_int,
        default=1000,
    )
    add(
        "--responses-store-max-bytes",
        "KUBEINFER_RESPONSES_STORE_MAX_BYTES",
        "Bytes of stored responses kept at most (their JSON size)",
        type=_positive_int,
        default=64 * 1024 * 1024,
    )
    add(
        "--responses-store-ttl",
        "KUBEINFER_RESPONSES_STORE_TTL",
        "Seconds a stored response is kept (0 = until evicted)",
        type=_non_negative_float,
        default=3600.0,
    )
    add(
        "--tensor-parallel-size",
        "TENSOR_PARALLEL_SIZE",
        "shard the model over N processes, one per device (torch.distributed: NCCL on GPUs, gloo on CPU)",
        type=_positive_int,
        default=1,
    )
    add(
        "--distributed-timeout",
        "KUBEINFER_DISTRIBUTED_TIMEOUT",
        "seconds a tensor-parallel collective may wait before the engine gives up (/health 503, exit 1)",
        type=float,
        default=300.0,
    )
    # Multi-node tensor parallelism (vLLM's flag names; the defaults come from the variables a
    # LeaderWorkerSet injects into every pod, so the operator renders none of them).
    add(
        "--nnodes",
        "LWS_GROUP_SIZE",
        "nodes (pods) the tensor-parallel group spans",
        type=_positive_int,
        default=1,
    )
    add(
        "--node-rank",
        "LWS_WORKER_INDEX",
        "this node's index in the group: 0 serves the API, others run the worker loop only",
        type=int,
        default=0,
    )
    add(
        "--master-addr",
        "LWS_LEADER_ADDRESS",
        "address of node 0, where the tensor-parallel rendezvous store listens",
        default="127.0.0.1",
    )
    add(
        "--master-port",
        "MASTER_PORT",
        "port of the rendezvous store on node 0 (default: 29500 across nodes, any free port on one)",
        type=int,
    )

    g = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    add_bool("--enable-lora", "ENABLE_LORA", "Serve LoRA adapters on top of the base model", False, g)
    lora_env = env.get("LORA_MODULES", "")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[parse_lora_module(m) for m in lora_env.split()] if lora_env else [],
        help='Adapters to load at start: name=path, or JSON {"name", "path", "base_model_name"}; '
        "a path is a PEFT folder or a hub repo id [env: LORA_MODULES, space-separated]",
    )
    add("--max-loras", "MAX_LORAS", "Most distinct adapters in one batch", type=_positive_int, default=1)
    add("--max-lora-rank", "MAX_LORA_RANK", "Largest adapter rank accepted", type=_positive_int, default=16)
    add(
        "--max-cpu-loras",
        "MAX_CPU_LORAS",
        "Adapters kept loaded in memory, LRU beyond (default: --max-loras)",
        type=_positive_int,
    )
    add_bool(
        "--allow-runtime-lora-updating",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "Mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
        False,
        g,
    )
    add(
        "--lora-allowed-paths",
        "LORA_ALLOWED_PATHS",
        "Folders POST /v1/load_lora_adapter may read local adapters from, symlinks resolved "
        "(JSON list or comma-separated; default: the --lora-modules paths and --cache-dir)",
        type=parse_str_list,
        default=(),
    )
    del g

    add(
        "--api-key",
        "API_KEY",
        "Require 'Authorization: Bearer <key>' on generation routes "
        "(/health, /ready, /metrics, /info stay open)",
    )
    add(
        "--admin-api-key",
        "KUBEINFER_ADMIN_API_KEY",
        "Management credential: the state-changing routes (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter, /flush_cache, /reset_prefix_cache) require 'Authorization: Bearer <key>' "
        "with it (it also opens every other route). Without it they take --api-key; with neither they "
        "answer 403 unless --host is a loopback address (local development)",
    )
    add(
        "--drain-timeout",
        "KUBEINFER_DRAIN_TIMEOUT",
        "On SIGTERM, seconds to let admitted requests finish",
        type=float,
        default=30.0,
    )
    add(
        "--timeout-request-head",
        "KUBEINFER_TIMEOUT_REQUEST_HEAD",
        "Seconds a connection may take to send its request line and headers (then 408 and closed)",
        type=float,
        default=30.0,
    )
    add(
        "--timeout-request-body",
        "KUBEINFER_TIMEOUT_REQUEST_BODY",
        "Seconds a request may take to send its whole body after its head (then 408 and closed); "
        "a request counts against --max-concurrent-requests only once its body is read",
        type=float,
        default=60.0,
    )
    add(
        "--limit-concurrency",
        "KUBEINFER_LIMIT_CONCURRENCY",
        "Connections open at once; more are answered 503 and closed when they connect (uvicorn's "
        "flag, refused at accept rather than after a request head)",
        type=int,
        default=1024,
    )
    add(
        "--limit-concurrency-per-client",
        "KUBEINFER_LIMIT_CONCURRENCY_PER_CLIENT",
        "Connections open at once from one client address (the socket's peer; behind a proxy, the "
        "proxy's); more are answered 503 and closed",
        type=int,
        default=256,
    )
    add_bool(
        "--ui", "KUBEINFER_UI", "Serve the chat playground at GET / (browsers); --no-ui turns it off", True
    )
    add(
        "--allowed-origins",
        "KUBEINFER_ALLOWED_ORIGINS",
        "CORS: origins browsers may call from (JSON list or comma-separated; vLLM's flag)",
        type=parse_str_list,
        default=("*",),
    )
    add(
        "--allowed-methods",
        "KUBEINFER_ALLOWED_METHODS",
        "CORS: allowed methods (JSON list or comma-separated)",
        type=parse_str_list,
        default=("*",),
    )
    add(
        "--allowed-headers",
        "KUBEINFER_ALLOWED_HEADERS",
        "CORS: allowed request headers (JSON list or comma-separated)",
        type=parse_str_list,
        default=("*",),
    )
    add_bool(
        "--allow-credentials",
        "KUBEINFER_ALLOW_CREDENTIALS",
        "CORS: allow credentials (cookies, Authorization) in cross-origin requests",
        False,
    )
    add("--log-format", "LOG_FORMAT", "Log line format", default="text", choices=LOG_FORMATS)
    add(
        "--log-level", "LOG_LEVEL", "Log level", default="info", choices=("debug", "info", "warning", "error")
    )
    return parser


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_cache_dtype(text: str) -> str:
    if text in KV_CACHE_FP8_NAMES:
        raise argparse.ArgumentTypeError(
            f"fp8 KV caches ({text}) are not supported; choose from {', '.join(KV_CACHE_DTYPE_CHOICES)}"
        )
    if text not in KV_CACHE_DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r}; choose from {', '.join(KV_CACHE_DTYPE_CHOICES)}"
        )
    return text


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    model = ModelConfig(
        model=args.model,
        dtype=args.dtype,
        quantize=args.quantize,
        cache_dir=args.cache_dir,
        served_model_name=args.served_model_name,
        max_model_len=args.max_total_tokens,
        chat_template=args.chat_template,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        logprobs_mode=args.logprobs_mode,
        task=args.task,
    )
    cache = CacheConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        cache_dtype=args.kv_cache_dtype,
    )
    engine = EngineConfig(
        model=model,
        cache=cache,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        prefill_itl_factor=args.prefill_itl_factor,
        prefill_itl_min_tokens=args.prefill_itl_min_tokens,
        burst_itl_factor=args.burst_itl_factor,
        burst_itl_seconds=args.burst_itl_seconds,
        pooling_step_tokens=args.pooling_step_tokens,
        scheduling_policy=args.scheduling_policy,
        max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend,
        device=args.device,
        num_threads=args.num_threads,
        thread_policy=args.thread_policy,
        batch_wait_ms=args.batch_wait_ms,
        speculative=parse_speculative_config(args.speculative_config) if args.speculative_config else None,
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_timeout_s=args.distributed_timeout,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
        ),
        kv_events=args.kv_events_config or KVEventsConfig(),
        lora=LoRAConfig(
            enable_lora=args.enable_lora,
            lora_modules=tuple(args.lora_modules),
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            allow_runtime_updating=args.allow_runtime_lora_updating,
            allowed_paths=tuple(args.lora_allowed_paths),
        ),
    )
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        max_concurrent_requests=args.max_concurrent_requests,
        max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens,
        max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences,
        max_top_n_tokens=args.max_top_n_tokens,
        api_key=args.api_key or None,
        admin_api_key=args.admin_api_key or None,
        drain_timeout_s=args.drain_timeout,
        timeout_request_head_s=args.timeout_request_head,
        timeout_request_body_s=args.timeout_request_body,
        limit_concurrency=args.limit_concurrency,
        limit_concurrency_per_client=args.limit_concurrency_per_client,
        log_format=args.log_format,
        max_payload_bytes=args.max_payload_bytes,
        objective_priorities=args.objective_priority,
        ui=args.ui,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser or None,
        responses_store=ResponsesStoreConfig(
            enabled=args.enable_responses_store,
            max_entries=args.responses_store_max_entries,
            max_bytes=args.responses_store_max_bytes,
            ttl_s=args.responses_store_ttl,
        ),
    )


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = __import__("time").gmtime
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    setup_logging(config.log_format, args.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not config.engine.parallel.is_leader:  # a worker pod of a multi-node group: no API
        from server.distributed.node import run_worker_node

        return run_worker_node(config.engine, config.host, config.port)
    from server.api.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
