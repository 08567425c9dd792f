"""Decoder models as embedders (last-token pooling, as gte-Qwen2 and Qwen3-Embedding do): our
Llama/Qwen2/Qwen3 model (server/models/llama.py) run as one dense causal pass over a padded batch, with no
paged KV cache (nothing is kept after the forward). Same weights, same modules as generation.

`forward(input_ids, token_type_ids, attention_mask)`: int64 `[batch, seq]` right-padded ->
`[batch, seq, hidden]` final-norm hidden states in the weights' dtype; token_type_ids are ignored.
Padding may be on either side (Qwen3-Embedding's tokenizer pads on the left): each row's positions
count its own tokens only, and a padded query attends to itself, so no row of the softmax is empty.
A layer with a sliding window W (`Attention.sliding_window`: Mistral's e5-style embedders, Qwen2 with
use_sliding_window) lets the query at position p see positions p - W + 1 .. p only, as in generation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.models.llama import LlamaForCausalLM, apply_rotary


class DecoderEncoder(nn.Module):
    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        m = self.model
        b, s = input_ids.shape
        h = m.model.embed_tokens(input_ids)  # [B, S, hidden]
        real = attention_mask.bool()
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, S]: left padding shifts nothing
        cos, sin = m.rotary.cos_sin(positions.reshape(-1), h.dtype)  # [B * S, 1, D]
        cos, sin = cos.view(b, s, 1, -1), sin.view(b, s, 1, -1)
        # causal, and no query attends to a padded key: [B, 1, S, S] boolean (True = attend); a padded
        # query keeps its diagonal (an all-masked row would be NaN and reach real rows through V)
        eye = torch.eye(s, dtype=torch.bool, device=h.device)[None, None]
        allowed = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()[None, None]
        allowed = (allowed & real[:, None, None, :]) | eye
        # [B, 1, S, S]: the key's position is within W - 1 of the query's (per row: padding counts no position)
        distance = positions[:, None, :, None] - positions[:, None, None, :]
        windowed: dict[int, Tensor] = {}
        for layer in m.decoder_layers():
            attn = layer.self_attn
            mask = allowed
            if attn.sliding_window is not None:
                w = attn.sliding_window
                if w not in windowed:
                    windowed[w] = (allowed & (distance < w)) | eye
                mask = windowed[w]
            x = layer.input_layernorm(h)
            hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
            if attn.qkv_proj is not None:
                qkv = attn.qkv_proj(x)
                q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q, k = q.reshape(b, s, hq, d), k.reshape(b, s, hkv, d)
            if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3: per head, before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = apply_rotary(q, cos, sin).transpose(1, 2)
            k = apply_rotary(k, cos, sin).transpose(1, 2)
            v = v.view(b, s, hkv, d).transpose(1, 2)
            if hkv != hq:
                k = k.repeat_interleave(hq // hkv, dim=1)
                v = v.repeat_interleave(hq // hkv, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, hq * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.model.norm(h)
