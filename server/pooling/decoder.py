"""Decoder models as embedders (last-token pooling, as gte-Qwen2 and Qwen3-Embedding do): our
Llama/Qwen2 model (server/models/llama.py) run as one dense causal pass over a padded batch, with no
paged KV cache (nothing is kept after the forward). Same weights, same modules as generation.

`forward(input_ids, token_type_ids, attention_mask)`: int64 `[batch, seq]` right-padded ->
`[batch, seq, hidden]` final-norm hidden states in the weights' dtype; token_type_ids are ignored.
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
        positions = torch.arange(s, device=input_ids.device)
        cos, sin = m.rotary.cos_sin(positions, h.dtype)  # [S, 1, D]
        # causal, and no query attends to a padded key: [B, 1, S, S] boolean (True = attend)
        allowed = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()[None, None]
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        for layer in m.decoder_layers():
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
            if attn.qkv_proj is not None:
                qkv = attn.qkv_proj(x)
                q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = apply_rotary(q.view(b, s, hq, d), cos, sin).transpose(1, 2)
            k = apply_rotary(k.view(b, s, hkv, d), cos, sin).transpose(1, 2)
            v = v.view(b, s, hkv, d).transpose(1, 2)
            if hkv != hq:
                k = k.repeat_interleave(hq // hkv, dim=1)
                v = v.repeat_interleave(hq // hkv, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=attn.scale)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, hq * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.model.norm(h)
