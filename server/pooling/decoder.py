"""Decoder models as embedders (gte-Qwen2, Qwen3-Embedding, e5-mistral, EmbeddingGemma): our model
(server/models/llama.py, every registered architecture's layers) run over a padded batch in one pass,
with no paged KV cache (nothing is kept after the forward). Same weights, same modules, same forward as
generation: only the attention backend differs (`packed_attention.PackedRowsAttention`: each row's real
tokens on their own, the compiled bf16 prefill kernel where the model multiplies in bf16; the masked SDPA
over the padded grid, `dense_attention.DenseBatchAttention`, for what it does not take).

`forward(input_ids, token_type_ids, attention_mask)`: int64 `[batch, seq]` -> `[batch, seq, hidden]`
final-norm hidden states in the weights' dtype (zeros at padding); token_type_ids are ignored. Padding
may be on either side (Qwen3-Embedding's tokenizer pads on the left): the layers run on the real tokens
only (packed), each row's positions count its own tokens. Causal models: the query at position p sees
p - W + 1 .. p in a layer with window W (Mistral, Qwen2's use_sliding_window, Gemma 3), 0 .. p
otherwise. A bidirectional model (`ArchConfig.bidirectional`, EmbeddingGemma) sees every key of its row,
or in a windowed layer those with |p - key| < W, as transformers' Gemma 3 masks do.
"""

from __future__ import annotations

import logging
import subprocess

import torch
from torch import Tensor, nn

from server.attention import AttentionMetadata
from server.attention.cpu_kernel import DecodeKernel, KernelBuildError, load_decode_kernel
from server.models.llama import LlamaForCausalLM
from server.models.serving_weights import ServingWeightsReport, cpu_packing_supported, prepare_for_serving

from .dense_attention import DenseBatchAttention
from .packed_attention import PackedRowsAttention

__all__ = ["DecoderEncoder", "DenseBatchAttention", "bf16_attention_kernel", "prepare_for_pooling"]

log = logging.getLogger(__name__)


def _no_cache_metadata(device: torch.device) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    return AttentionMetadata(empty.long(), empty.view(0, 0), empty, empty, 0, 0, (), ())


class DecoderEncoder(nn.Module):
    def __init__(self, model: LlamaForCausalLM, attention_kernel: DecodeKernel | None = None) -> None:
        """`attention_kernel`: the compiled prefill kernel for bf16 attention of causal rows (a model that
        multiplies in bf16: `bf16_attention_kernel`); None keeps attention in the stream's dtype."""
        super().__init__()
        self.model = model
        self.attention_kernel = attention_kernel

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        m = self.model
        b, s = input_ids.shape
        real = attention_mask.bool()  # [B, S]
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, S]: left padding shifts nothing
        backend = PackedRowsAttention(real, positions, m.config.bidirectional, self.attention_kernel)
        empty = torch.zeros(0, device=input_ids.device)
        caches = [(empty, empty)] * len(m.model.layers)
        meta = _no_cache_metadata(input_ids.device)
        h = m(input_ids[real], positions[real], caches, meta, backend)  # type: ignore[arg-type]  # [T, hidden]
        out = h.new_zeros(b * s, h.shape[-1])
        out[real.reshape(-1).nonzero().squeeze(1)] = h
        return out.view(b, s, -1)


def prepare_for_pooling(model: LlamaForCausalLM, bf16_gemms: bool = False) -> ServingWeightsReport | None:
    """Generation's serving preparation for an fp32 embedder on the CPU (models/serving_weights.py): q/k/v
    and gate/up fused, every projection pre-packed for oneDNN, and for Llama-layer models the compiled
    add+RMSNorm, rotary and silu*up ops; the same function up to fp32 summation order. 80% of a
    Qwen3-Embedding-0.6B-shaped step was fp32 `F.linear`, which re-lays its weight out on every call.
    `bf16_gemms`: the projections multiply in bf16 around the fp32 stream (bf16_linear.Bf16GemmLinear;
    `--dtype auto` where the CPU computes bf16 natively), as a BERT embedder's do. The LM head is dropped
    first (an embedder never computes logits; packing the tied head would copy the vocabulary's
    embedding). None (nothing done) for other dtypes and devices."""
    p = next(model.parameters())
    if not cpu_packing_supported(p.device, p.dtype):
        return None
    model.lm_head = nn.Identity()  # type: ignore[assignment]
    return prepare_for_serving(model, p.device, p.dtype, bf16_gemms=bf16_gemms)


def bf16_attention_kernel(model: LlamaForCausalLM) -> DecodeKernel | None:
    """The compiled prefill kernel for an embedder that multiplies in bf16 (`--dtype auto` on a CPU with
    native bf16, `--dtype bfloat16`): its attention then takes bf16 products with fp32 sums, as the GEMMs
    around it, in one call a layer instead of a masked SDPA over the padded batch. None where the kernel
    cannot serve this model (no usable AVX512-BF16, a head_dim other than 64, 128 or 256, a bidirectional
    model) or does not build here (logged): attention stays in the stream's dtype."""
    cfg = model.config
    if cfg.bidirectional:
        return None
    try:
        kernel = load_decode_kernel()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("CPU attention kernel unavailable, the embedder attends with torch's SDPA: %s", e)
        return None
    head_dims = {layer.self_attn.head_dim for layer in model.decoder_layers()}
    if not all(kernel.prefill_supported(torch.bfloat16, torch.bfloat16, d) for d in head_dims):
        return None
    return kernel
