"""Loads a pooling model from a Hugging Face / sentence-transformers folder.

`task` embed: BertModel (architectures BertModel / BertForMaskedLM / no head) + the folder's pooling;
`task` score: BertForSequenceClassification (a cross-encoder). Weights come from model.safetensors
(with or without the `bert.` prefix); `embeddings.position_ids` buffers are skipped. In fp32 on the
CPU the encoder's layers are replaced by their fused, pre-packed form (bert_cpu.py), their GEMMs in
fp32 or bf16 (`--dtype`, `pooling_dtypes`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from server.models.arch import BASE_MODEL_ARCHITECTURES
from server.models.registry import ARCHITECTURES
from server.tokenizer import load_hf_tokenizer

from .bert import BertConfig, BertForSequenceClassification, BertModel
from .bert_cpu import cpu_layers_supported, use_cpu_layers
from .dense import DenseStack, load_dense_stack
from .pooler import PoolingConfig, PoolingMode


class PoolingTask(enum.StrEnum):
    EMBED = "embed"
    SCORE = "score"  # cross-encoder: one score per (query, document) pair; /classify too


_ENCODER_ARCHS = {"BertModel", "BertForMaskedLM", "BertForPreTraining"}
_CLASSIFIER_ARCHS = {"BertForSequenceClassification"}
# our generative architectures (server/models/arch.py) served as last-token embedders (pooling/decoder.py)
_DECODER_ARCHS = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
}
# their headless base models (sentence-transformers saves these): they cannot generate, so they embed
_BASE_DECODER_ARCHS = set(BASE_MODEL_ARCHITECTURES)


def detect_task(folder: Path) -> PoolingTask | None:
    """The pooling task a folder's config.json implies, or None for a generative model."""
    cfg = json.loads((folder / "config.json").read_text())
    archs = set(cfg.get("architectures") or [])
    if archs & _CLASSIFIER_ARCHS:
        return PoolingTask.SCORE
    if archs & _ENCODER_ARCHS or (not archs and cfg.get("model_type") == "bert"):
        return PoolingTask.EMBED
    if archs & _DECODER_ARCHS and (folder / "modules.json").is_file():
        return PoolingTask.EMBED  # a sentence-transformers folder around a decoder (gte-Qwen2 style)
    if archs & _BASE_DECODER_ARCHS and not archs & _DECODER_ARCHS:
        return PoolingTask.EMBED  # Qwen3Model and the like: no LM head, nothing to generate with
    return None


@dataclass
class PoolingModel:
    """A loaded pooling model. `forward(ids, types, mask)` gives `[batch, hidden_size]` pooled float32
    vectors (embed: after the Dense modules, before normalization) or `[batch, num_labels]` float32
    logits (score). `hidden_size`: the embedding's width (the last Dense's out_features, if any)."""

    task: PoolingTask
    module: nn.Module
    tokenizer: PreTrainedTokenizerBase
    pooling: PoolingConfig
    max_model_len: int
    hidden_size: int
    num_labels: int
    id2label: dict[int, str]
    dtype: torch.dtype
    num_parameters: int
    # the dtype the encoder's projections multiply in: bf16 for a BERT encoder's bf16 GEMMs over fp32
    # weights (bert_cpu.py) and for a decoder loaded in bf16; what /info's model_dtype reports
    gemm_dtype: torch.dtype = torch.float32
    # sentence-transformers' Dense modules after the pooling (dense.py); hidden_size is then their output's
    dense: DenseStack | None = None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if self.task is PoolingTask.SCORE:
            return self.module(input_ids, token_type_ids, mask).float()
        return self._pool(self.module(input_ids, token_type_ids, mask), mask)

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden `[batch, seq, dim]`, mask `[batch, seq]` -> `[batch, hidden_size]` float32: the pooling,
        then the Dense modules if the folder has any."""
        from .pooler import pool

        pooled = pool(hidden, mask, self.pooling.mode)
        return pooled if self.dense is None else self.dense(pooled)

    @torch.inference_mode()
    def forward_rows(
        self,
        input_ids: torch.Tensor,  # [batch, seq] int64, right-padded
        token_type_ids: torch.Tensor,  # [batch, seq] int64
        mask: torch.Tensor,  # [batch, seq] 1 for real tokens
        per_token: list[bool],  # per row: every token's hidden state instead of the pooled vector
    ) -> list[torch.Tensor]:
        """One forward; each row's float32 result: `[dim]` pooled, `[num_labels]` logits, or, where
        `per_token`, `[num_tokens, dim]` last hidden states (embedding models only: ValueError else)."""
        if not any(per_token):
            return list(self.forward(input_ids, token_type_ids, mask))
        if self.task is PoolingTask.SCORE:
            raise ValueError("per-token embeddings need an embedding model")
        hidden = self.module(input_ids, token_type_ids, mask)  # [batch, seq, dim]
        pooled = self._pool(hidden, mask)
        lengths = mask.sum(dim=1).tolist()
        return [
            hidden[i, : int(lengths[i])].float() if flag else pooled[i] for i, flag in enumerate(per_token)
        ]


def load_pooling_model(
    folder: Path,
    task: PoolingTask | None = None,
    dtype: torch.dtype = torch.float32,
    gemm_dtype: torch.dtype | Literal["auto"] = torch.float32,
) -> PoolingModel:
    """`gemm_dtype` "auto" (`--dtype auto`): bf16 GEMMs for an embedder (BERT or decoder) where the CPU
    computes bf16 natively (loader.cpu_has_native_bf16), fp32 for cross-encoders and elsewhere
    (`auto_gemm_dtype`). Raises ValueError when the folder is not a supported pooling model for
    `task`, or for a bfloat16 `gemm_dtype` (fp32 BERT weights, bf16 GEMMs: bert_cpu.py) where that
    path cannot run."""
    cfg = json.loads((folder / "config.json").read_text())
    archs = set(cfg.get("architectures") or [])
    # auto: the embedder families above; --task embed: any registered architecture
    decoders = (
        _DECODER_ARCHS | _BASE_DECODER_ARCHS | (set(ARCHITECTURES) if task is PoolingTask.EMBED else set())
    )
    if task in (None, PoolingTask.EMBED) and archs & decoders:
        # --dtype bfloat16: bf16 weights, the model in bf16 throughout; auto: fp32 weights and stream, bf16
        # GEMMs where the CPU computes bf16 natively (auto_gemm_dtype, bf16_linear.Bf16GemmLinear)
        if gemm_dtype == torch.bfloat16:
            return _load_decoder(folder, cfg, torch.bfloat16)
        bf16_gemms = gemm_dtype == "auto" and auto_gemm_dtype(PoolingTask.EMBED, dtype) == torch.bfloat16
        return _load_decoder(folder, cfg, dtype, bf16_gemms)
    found = detect_task(folder)
    if found is None:
        raise ValueError(
            f"{folder}: architectures {cfg.get('architectures')} are not a supported pooling model"
        )
    task = task or found
    if cfg.get("model_type", "bert") != "bert":
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not supported by the BERT encoder")
    if task is PoolingTask.SCORE and found is not PoolingTask.SCORE:
        raise ValueError("task score needs a sequence-classification checkpoint (a cross-encoder)")
    bc = BertConfig.from_dict(cfg)
    module: nn.Module
    module = BertForSequenceClassification(bc) if task is PoolingTask.SCORE else BertModel(bc)
    state = load_file(str(folder / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.endswith("position_ids")}
    if task is PoolingTask.EMBED:
        state = {k.removeprefix("bert."): v for k, v in state.items()}
        state = {k: v for k, v in state.items() if k.startswith(("embeddings.", "encoder."))}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    module = module.to(dtype).eval()
    num_parameters = _parameters(module)  # before packing hides them
    encoder = module.bert if isinstance(module, BertForSequenceClassification) else module
    assert isinstance(encoder, BertModel)
    if gemm_dtype == "auto":  # bf16 GEMMs only where the fused layers run them
        native = cpu_layers_supported(encoder, dtype)
        gemm_dtype = auto_gemm_dtype(task, dtype) if native else torch.float32
    if cpu_layers_supported(encoder, dtype):  # fused, pre-packed fp32 layers (bert_cpu.py)
        use_cpu_layers(encoder, gemm_dtype)
    elif gemm_dtype != torch.float32:
        raise ValueError("bfloat16 GEMMs need float32 weights on a CPU with oneDNN")
    else:
        gemm_dtype = dtype  # the plain layers multiply in their weights' dtype
    pooling = PoolingConfig.from_folder(folder, PoolingMode.CLS, cfg)
    max_len = min(pooling.max_seq_length or bc.max_position_embeddings, bc.max_position_embeddings)
    labels = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    dense = load_dense_stack(folder, pooling.dense, bc.hidden_size) if pooling.dense else None
    return PoolingModel(
        task=task,
        module=module,
        tokenizer=load_hf_tokenizer(folder),
        pooling=pooling,
        max_model_len=max_len,
        hidden_size=dense.out_features if dense is not None else bc.hidden_size,
        num_labels=bc.num_labels,
        id2label=labels or {i: f"LABEL_{i}" for i in range(bc.num_labels)},
        dtype=dtype,
        num_parameters=num_parameters + _parameters(dense),
        gemm_dtype=gemm_dtype,
        dense=dense,
    )


def auto_gemm_dtype(task: PoolingTask, dtype: torch.dtype) -> torch.dtype:
    """`--dtype auto`'s GEMM dtype for a BERT model or decoder embedder with `dtype` weights: bf16 for an
    embedder on a CPU with native bf16 (AVX512-BF16 or AMX-BF16, what the OS enables minus KUBEINFER_CPU_DISABLE: the
    rule generation's `--dtype auto` follows, loader.resolve_dtype), fp32 otherwise. all-MiniLM-L6-v2's
    vectors keep cosine >= 0.99997 against sentence-transformers' fp32 that way (tests/pooling/
    test_bert_cpu.py). A cross-encoder stays fp32: its scores are used as values (thresholds, sigmoid
    probabilities), and bf16 GEMMs moved the tests' random cross-encoder's logits by up to 0.09 (of
    1.2-3.1), where fp32 matches a sentence-transformers CrossEncoder to 1e-5."""
    from server.models.loader import cpu_has_native_bf16

    if task is PoolingTask.EMBED and dtype == torch.float32 and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def pooling_dtypes(name: str) -> dict[str, Any]:
    """`--dtype` for a pooling model, as `load_pooling_model`'s keyword arguments. float32: fp32
    everywhere; bfloat16: fp32 weights and activations with bf16 GEMMs for a BERT encoder
    (bert_cpu.py), bf16 weights for a decoder embedder; auto: bf16 GEMMs around fp32 activations for an
    embedder (BERT: bert_cpu.py; decoder: bf16_linear.py) on a CPU with native bf16, fp32 for the rest
    (`auto_gemm_dtype`). Raises ValueError for float16, which
    the CPU path does not run."""
    if name == "auto":
        return {"dtype": torch.float32, "gemm_dtype": "auto"}
    if name == "float32":
        return {"dtype": torch.float32, "gemm_dtype": torch.float32}
    if name == "bfloat16":
        return {"dtype": torch.float32, "gemm_dtype": torch.bfloat16}
    raise ValueError(f"--dtype {name} is not supported for pooling models (auto, float32 or bfloat16)")


def resolve_task(model: str | None, task: str) -> str:
    """`--task` resolved before loading: `generate`, `embed` or `score`. auto: a local folder whose
    config.json names a BERT encoder embeds, a BERT sequence classifier scores, anything else generates."""
    if task != "auto":
        return task
    if not model:
        return "generate"
    folder = Path(model).expanduser()
    if folder.suffix == ".gguf":  # an EmbeddingGemma GGUF embeds (models/gguf_embedder.py)
        from server.gguf_file import GgufFileError
        from server.models.gguf_embedder import is_gguf_embedder

        try:
            return "embed" if is_gguf_embedder(folder) else "generate"
        except GgufFileError:  # the load reports it, through the server's load-failure path (exit 1)
            return "generate"
    if not (folder / "config.json").is_file():
        return "generate"
    found = detect_task(folder)
    return found.value if found is not None else "generate"


def _load_decoder(folder: Path, cfg: dict, dtype: torch.dtype, bf16_gemms: bool = False) -> PoolingModel:
    """A Llama/Mistral/Qwen2/Qwen3/Gemma 3 checkpoint (or its headless base model: EmbeddingGemma's
    bidirectional Gemma3TextModel) as an embedder: last-token pooling and L2 normalization unless the
    folder's modules.json says otherwise (vLLM's default for decoder embedders too), then its Dense
    modules."""
    from server.models.loader import load_model
    from server.models.serving_weights import cpu_packing_supported

    from .decoder import DecoderEncoder, bf16_attention_kernel, prepare_for_pooling

    max_pos = int(cfg.get("max_position_embeddings") or 8192)
    pooling = PoolingConfig.from_folder(folder, PoolingMode.LAST, cfg)
    if not (folder / "modules.json").is_file():
        pooling = dataclasses.replace(pooling, mode=PoolingMode.LAST, normalize=True)
    max_len = min(pooling.max_seq_length or max_pos, max_pos)
    loaded = load_model(folder, dtype, torch.device("cpu"), max_positions=max_len, embedding_only=True)
    bf16_gemms = bf16_gemms and cpu_packing_supported(torch.device("cpu"), torch.bfloat16)
    prepared = prepare_for_pooling(loaded.model, bf16_gemms)
    # attention in bf16 products where the GEMMs multiply in bf16 (packed_attention.py)
    bf16 = (prepared is not None and bf16_gemms) or dtype == torch.bfloat16
    kernel = bf16_attention_kernel(loaded.model) if bf16 else None
    module = DecoderEncoder(loaded.model, kernel).eval()
    tok = load_hf_tokenizer(folder)
    hidden = int(cfg["hidden_size"])
    dense = load_dense_stack(folder, pooling.dense, hidden) if pooling.dense else None
    return PoolingModel(
        task=PoolingTask.EMBED,
        module=module,
        tokenizer=tok,
        pooling=pooling,
        max_model_len=max_len,
        hidden_size=dense.out_features if dense is not None else hidden,
        num_labels=1,
        id2label={},
        dtype=dtype,
        num_parameters=loaded.num_parameters + _parameters(dense),
        gemm_dtype=torch.bfloat16 if prepared is not None and bf16_gemms else dtype,
        dense=dense,
    )


def _parameters(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())
