"""Decoder models as embedders (gte-Qwen2, Qwen3-Embedding, e5-mistral, EmbeddingGemma): our model
(server/models/llama.py, every registered architecture's layers) run over a padded batch in one pass,
with no paged KV cache (nothing is kept after the forward). Same weights, same modules, same forward as
generation: only the attention backend differs (`DenseBatchAttention`, masked SDPA over the batch).

`forward(input_ids, token_type_ids, attention_mask)`: int64 `[batch, seq]` -> `[batch, seq, hidden]`
final-norm hidden states in the weights' dtype (zeros at padding); token_type_ids are ignored. Padding
may be on either side (Qwen3-Embedding's tokenizer pads on the left): the layers run on the real tokens
only (packed), each row's positions count its own tokens. Causal models: the query at position p sees
p - W + 1 .. p in a layer with window W (Mistral, Qwen2's use_sliding_window, Gemma 3), 0 .. p
otherwise. A bidirectional model (`ArchConfig.bidirectional`, EmbeddingGemma) sees every key of its row,
or in a windowed layer those with |p - key| < W, as transformers' Gemma 3 masks do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.attention import AttentionMetadata
from server.attention.cpu_kernel import check_softcap
from server.models.llama import LlamaForCausalLM
from server.models.serving_weights import ServingWeightsReport, cpu_packing_supported, prepare_for_serving


class DenseBatchAttention:
    """An attention backend (server/attention/backend.py's protocol) for one padded batch: scatters the
    packed real tokens' q/k/v into `[batch, heads, seq, head_dim]`, one masked SDPA, gathers back. The
    caches and metadata it is handed are ignored."""

    name = "dense-batch"

    def __init__(
        self,
        real: Tensor,  # [B, S] bool, a real token
        positions: Tensor,  # [B, S] int64, each real token's position in its row
        bidirectional: bool,
    ) -> None:
        b, s = real.shape
        self.shape = (b, s)
        self.index = real.reshape(-1).nonzero().squeeze(1)  # [T]: the real tokens in the [B * S] grid
        # [B, 1, S, S] True = attend: real keys only; a padded query keeps its diagonal (an all-masked
        # row is NaN in SDPA; those rows are dropped after)
        self._eye = torch.eye(s, dtype=torch.bool, device=real.device)[None, None]
        keys = real[:, None, None, :]
        self._positions = positions.to(torch.int32)  # [B, S]; distances are made per window, then freed
        if not bidirectional:
            keys = keys & torch.ones(s, s, dtype=torch.bool, device=real.device).tril()[None, None]
        self._keys = keys
        self._bidirectional = bidirectional
        self._masks: dict[int | None, Tensor] = {None: keys | self._eye}

    def mask(self, window: int | None) -> Tensor:  # [B, 1, S, S] bool
        if window not in self._masks:
            assert window is not None  # the global mask is made in __init__
            p = self._positions
            distance = p[:, None, :, None] - p[:, None, None, :]  # [B, 1, S, S] query - key
            near = distance.abs() < window if self._bidirectional else distance < window
            self._masks[window] = (self._keys & near) | self._eye
        return self._masks[window]

    def _grid(self, x: Tensor) -> Tensor:  # x: [T, H, D] -> [B, H, S, D], zeros at padding
        b, s = self.shape
        out = x.new_zeros(b * s, x.shape[1], x.shape[2])
        out[self.index] = x
        return out.view(b, s, x.shape[1], x.shape[2]).transpose(1, 2)

    def forward(
        self,
        q: Tensor,  # [T, num_heads, head_dim]
        k: Tensor,  # [T, num_kv_heads, head_dim]
        v: Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        out_dtype: torch.dtype | None = None,
        sliding_window: int | None = None,
        sinks: Tensor | None = None,
        softcap: float = 0.0,
    ) -> Tensor:  # [T, num_heads, head_dim] in q's dtype
        cap = check_softcap(softcap)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        qg, kg, vg, mask = self._grid(q), self._grid(k), self._grid(v), self.mask(sliding_window)
        if cap or sinks is not None:
            o = _eager_attention(qg, kg, vg, mask, scale, cap, sinks).to(q.dtype)
        else:
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )  # [B, Hq, S, D]
        return o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[self.index]


def _eager_attention(
    q: Tensor,  # [B, Hq, S, D]
    k: Tensor,  # [B, Hkv, S, D]
    v: Tensor,  # [B, Hkv, S, D]
    mask: Tensor,  # [B, 1, S, S] bool, True = attend
    scale: float,
    softcap: float,  # 0, or the attention logit soft-cap
    sinks: Tensor | None,  # [Hq] fp32
) -> Tensor:  # [B, Hq, S, D] fp32
    """SDPA's result with what SDPA has no term for, as transformers' eager attention defines it (Gemma 2,
    gpt-oss): each scaled score s taken as cap * tanh(s / cap) before the mask, and a head's sink logit as
    one more score column that joins the softmax's denominator with no value row. All in fp32 (transformers
    multiplies in the input dtype and softmaxes in fp32). The G query heads of a KV head are one matmul over
    that head's keys (no repeated K/V); the scores take B * Hq * S^2 * 4 bytes, as SDPA's math path does."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scores = torch.matmul(q.float().view(b, hkv, g, s, d), k.float().unsqueeze(2).transpose(-1, -2))
    scores = scores.mul_(scale)  # [B, Hkv, G, S, S]
    if softcap:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink_col = sinks.float().view(1, hkv, g, 1, 1).expand(b, -1, -1, s, 1)
        probs = torch.cat([scores, sink_col], -1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.float().unsqueeze(2)).view(b, hq, s, d)


def _no_cache_metadata(device: torch.device) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    return AttentionMetadata(empty.long(), empty.view(0, 0), empty, empty, 0, 0, (), ())


class DecoderEncoder(nn.Module):
    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        m = self.model
        b, s = input_ids.shape
        real = attention_mask.bool()  # [B, S]
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, S]: left padding shifts nothing
        backend = DenseBatchAttention(real, positions, m.config.bidirectional)
        empty = torch.zeros(0, device=input_ids.device)
        caches = [(empty, empty)] * len(m.model.layers)
        meta = _no_cache_metadata(input_ids.device)
        h = m(input_ids[real], positions[real], caches, meta, backend)  # type: ignore[arg-type]  # [T, hidden]
        out = h.new_zeros(b * s, h.shape[-1])
        out[backend.index] = h
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
