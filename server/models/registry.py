"""The architectures we serve, by their Hugging Face `architectures` name.

A new architecture provides one module under server/models/archs/ with an `Architecture` entry:
its `model_type`, `configure` (config.json + the common fields -> the final `ArchConfig`: one
`LayerSpec` per layer and the model-level fields; refuse with `UnsupportedModelError` what the contract
cannot express), `rename_weights` where its checkpoint names differ from the shared layers' (Phi-3's fused
qkv_proj / gate_up_proj), and the text of its row in docs/models.md. Nothing else changes: the shared
layers (layers.py) read only the specs. `python -m server.models.registry --markdown` prints
docs/models.md (a test holds the file to it).
"""

from __future__ import annotations

import sys
from typing import Any

from server.models.arch import BASE_MODEL_ARCHITECTURES, ArchConfig
from server.models.architecture import Architecture
from server.models.layer_spec import UnsupportedModelError
from server.models.rope import check_rope_servable


def _collect() -> dict[str, Architecture]:
    from server.models.archs import gemma, gpt_oss, granite, llama, mixtral, olmo2, phi3, qwen_moe, smollm3

    entries = [
        *llama.ARCHITECTURES,
        granite.GRANITE,
        olmo2.OLMO2,
        smollm3.SMOLLM3,
        phi3.PHI3,
        *gemma.ARCHITECTURES,
        mixtral.MIXTRAL,
        *qwen_moe.ARCHITECTURES,
        gpt_oss.GPT_OSS,
    ]
    return {e.name: e for e in entries}


ARCHITECTURES: dict[str, Architecture] = _collect()


def by_model_type(model_type: str) -> Architecture | None:
    return next((e for e in ARCHITECTURES.values() if e.model_type == model_type), None)


def arch_from_hf(cfg: dict[str, Any], base_model_ok: bool = False) -> ArchConfig:
    """config.json -> ArchConfig, or UnsupportedModelError. `base_model_ok`: a headless base model
    (Qwen3Model, ...) reads as its causal-LM architecture (the pooling loader's case); otherwise it is
    refused: it has no LM head to generate with."""
    archs = cfg.get("architectures") or []
    if not archs:
        entry0 = by_model_type(cfg.get("model_type") or "")
        archs = [entry0.name] if entry0 is not None else []
    base = next((a for a in archs if a in BASE_MODEL_ARCHITECTURES), None)
    if base is not None and not any(a in ARCHITECTURES for a in archs):
        if not base_model_ok:
            raise UnsupportedModelError(
                f"{base} is a base model without an LM head: it cannot generate; serve it as an "
                "embedding model (--task embed)"
            )
        archs = [BASE_MODEL_ARCHITECTURES[base]]
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"expected one of {sorted(ARCHITECTURES)}"
        )
    e = ARCHITECTURES[arch]
    try:
        common = ArchConfig.common_from_hf(cfg, arch, e.model_type, qkv_bias=e.qkv_bias, qk_norm=e.qk_norm)
        return e.configure(cfg, common)
    except KeyError as err:
        raise UnsupportedModelError(f"config.json lacks the field {err}") from err


def check_servable(arch: ArchConfig, max_model_len: int) -> None:
    """Refuses (UnsupportedModelError) a config our attention cannot serve exactly at this length:
    dynamic NTK RoPE beyond max_position_embeddings. (Sliding windows are served by every attention
    backend, per layer: docs/design.md, "Sliding-window attention".)"""
    for spec in {s.rope for s in arch.layers if s.rope is not None}:
        check_rope_servable(spec, max_model_len, arch.max_position_embeddings)


def markdown() -> str:
    """docs/models.md, from the entries above."""
    lines = [
        "# Supported model architectures",
        "",
        "Generated from `server/models/registry.py` by `python -m server.models.registry --markdown`",
        "(tests/models/test_models_doc.py fails when this file differs). Formats: Hugging Face safetensors",
        "folders (dense, or prequantized GPTQ/AWQ where the quantization method allows) and GGUF files.",
        "Attention: every layer calls the configured backend (`cpu`, `torch`, `triton`) with its own",
        "scale, window and attention soft-cap (Gemma 2's, applied in each backend's kernels; the fused",
        "fp32 CPU path's decode steps take the decode graph's soft-capped kernel). Parity",
        "with transformers is tested on CPU for every",
        "row (tests/models/test_arch_parity.py, tests/engine/test_engine_parity.py,",
        "tests/moe/test_moe_arch_parity.py). Mixture-of-experts layers run `FusedMoE` (docs/design.md,",
        '"Mixture of experts"); `--quantize int8` quantizes their experts (other methods are refused);',
        "under tensor parallelism each expert's intermediate dimension is split across ranks (MXFP4",
        "experts where a rank's slice is whole 32-blocks). The fused CPU layer ops serve every row's dense",
        "layers and the decode graph every dense layer, Gemma 2's soft-capped attention included, and every",
        "MoE layer whose experts are quantized (GGUF, `--quantize int8`, MXFP4; Qwen2-MoE's shared expert too,",
        "held in its GGUF blocks or int8), in models served in fp32 (a GGUF as it is, `--dtype float32`) (the",
        "layer contract as data: `server/models/decode_graph.py`); tensor parallelism (MoE models aside) and",
        "calibrated quantization (`python -m server.quantize`) serve the Llama layer only (column 5);",
        "`--quantize` at load replaces projections by name in every architecture. Embeddings",
        "(`--task embed`, `server/pooling/decoder.py`: one dense pass, the",
        "sentence-transformers folder's pooling, Dense modules, Normalize and prompts) run every row's",
        "layers, attention soft-capping and sinks included (in fp32 outside SDPA, which has no term for them:",
        "BAAI/bge-multilingual-gemma2's headless `Gemma2Model` is served so); a Gemma 3 with",
        "`use_bidirectional_attention` (EmbeddingGemma, the headless `Gemma3TextModel`) embeds only.",
        "Sliding-window layers pass their window to the backend (interleaved with global layers too);",
        "where every layer is windowed, KV blocks out of the window are freed.",
        "",
        "| architecture | model_type | safetensors | GGUF | TP, calibrated quantization | layer features |",
        "|---|---|---|---|---|---|",
    ]
    for e in sorted(ARCHITECTURES.values(), key=lambda a: a.name):
        llama_layer = "yes" if e.llama_layer else "no"
        gguf = "yes" if e.gguf else "no"
        lines.append(
            f"| `{e.name}` | `{e.model_type}` | yes | {gguf} | {llama_layer} | {', '.join(e.features)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m server.models.registry --markdown")
    sys.stdout.write(markdown())
