"""`DenseBatchAttention`: a decoder embedder's batch attention as one masked SDPA over the padded grid, the
backend for what `packed_attention.PackedRowsAttention` does not take row by row (windows that reach inside a
row, sinks and soft-caps without the compiled kernel; a bidirectional model's windows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from server.attention import AttentionMetadata
from server.attention.cpu_kernel import check_softcap, check_window


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
        check_window(sliding_window)
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
