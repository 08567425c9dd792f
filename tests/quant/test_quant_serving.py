"""Every quantization method serves requests end to end: through LLMEngine, then through the HTTP API
(TGI /generate and /info) with the same engine.

On-the-fly methods run on a tiny random Llama (plumbing; their accuracy on a real model is in
test_quant_accuracy.py); AWQ and GPTQ run on SmolLM2 checkpoints written by our quantizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from serving import free_port, serve_in_thread

from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from server.engine import LLMEngine
from server.request import SamplingParams

ON_THE_FLY = ["int8", "int4", "fp8", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"]
PROMPT = "The capital of France is"


def _engine(model: Path, quantize: str | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model), quantize=quantize),
            cache=CacheConfig(num_kv_blocks=32),
            max_num_seqs=4,
            device="cpu",
            num_threads=1,
        )
    )


def _serve_and_check(llm: LLMEngine, quantize: str, max_new: int) -> str:
    """Greedy offline output, then the same request over HTTP; returns the HTTP text."""

    from server.api.app import create_app
    from server.api.state import ServerState

    prompt_ids = llm.tokenizer.encode(PROMPT)
    offline = llm.tokenizer.decode(
        llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_new))[0]
    )
    port = free_port()
    state = ServerState(
        ServerConfig(engine=llm.config, host="127.0.0.1", port=port), engine_factory=lambda: llm
    )
    # generous: the server thread starts slowly on a loaded machine
    with serve_in_thread(create_app(state), port, name=f"quant-{quantize}", timeout_s=300) as running:
        url = running.url
        info = httpx.get(f"{url}/info", timeout=10).json()
        assert info["quantization"] == quantize
        assert info["weight_bytes"] == llm.info.weight_bytes > 0
        r = httpx.post(
            f"{url}/generate",
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": max_new, "do_sample": False}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        text = r.json()["generated_text"]
        assert text == offline  # greedy: the HTTP path runs the same quantized model
        return str(text)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", tie=True)


@pytest.fixture(scope="module")
def dense_tiny_weight_bytes(tiny_llama: Path) -> int:
    return _engine(tiny_llama, None).info.weight_bytes


@pytest.mark.parametrize("method", ON_THE_FLY)
def test_quant_serves_on_the_fly(method: str, tiny_llama: Path, dense_tiny_weight_bytes: int) -> None:
    llm = _engine(tiny_llama, method)
    assert llm.info.quantization == method
    # Tiny model: the (dense) embeddings dominate, so only "less than dense" is meaningful here.
    assert llm.info.weight_bytes < dense_tiny_weight_bytes
    text = _serve_and_check(llm, method, max_new=4)
    assert len(llm.tokenizer.encode(text, add_special_tokens=False)) >= 1


@pytest.mark.parametrize("name", ["awq", "gptq"])
def test_quant_serves_prequantized_smollm2(name: str, quantized_checkpoint: Callable[[str], Path]) -> None:
    llm = _engine(quantized_checkpoint(name), None)  # detected from config.json
    assert llm.info.quantization == name
    text = _serve_and_check(llm, name, max_new=6)
    assert "Paris" in text


def test_quant_flag_matching_checkpoint_is_accepted_and_conflict_is_refused(
    quantized_checkpoint: Callable[[str], Path],
) -> None:
    folder = quantized_checkpoint("awq")
    assert _engine(folder, "awq").info.quantization == "awq"
    with pytest.raises(ValueError, match=r"--quantize int8 conflicts with the checkpoint.*'awq'"):
        _engine(folder, "int8")


@pytest.mark.slow
def test_quant_python_m_server_serves_our_awq_checkpoint(
    quantized_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """The documented flow: `python -m server --model DIR` on a checkpoint from `python -m server.quantize`."""
    import os
    import subprocess
    import sys

    folder = quantized_checkpoint("awq")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    env.pop("API_KEY", None)
    cmd = [sys.executable, "-m", "server", "--model", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--num-kv-blocks", "32", "--num-threads", "1"]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a server process loads slowly on a loaded machine
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.2)
        assert httpx.get(f"{url}/info", timeout=10).json()["quantization"] == "awq"
        r = httpx.post(
            f"{url}/generate",
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "do_sample": False}},
            timeout=120,
        )
        assert r.status_code == 200 and "Paris" in r.json()["generated_text"], r.text
        assert "quantization=awq" in log_path.read_text(errors="replace")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
