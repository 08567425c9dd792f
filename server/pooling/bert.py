"""Our BERT-family encoder with Hugging Face's module names, so BertModel and
BertForSequenceClassification checkpoints load as they are.

Source of the algorithm: Devlin et al. 2018 / transformers' `modeling_bert.py` (post-LayerNorm blocks,
absolute position embeddings, exact-erf GELU). Inputs are padded batches: `input_ids`, `token_type_ids`
and `attention_mask` int64 `[batch, seq]`; outputs are `[batch, seq, hidden]` in the weights' dtype
(zeros at padded positions when the batch has padding).

Padding is removed inside the encoder: every per-token op (projections, feed-forward, LayerNorm, most
of the FLOPs) runs on the packed `[tokens, hidden]` real tokens only, and only attention's score and
value products see the padded `[batch, heads, seq, seq]` shape (the unpadding of TEI / FlashAttention's
varlen BERT). A batch of texts of 8-40 words padded to its longest is ~40% padding. A batch with no
padding (one text, or texts of one length) gets no attention mask: SDPA's unmasked path. In fp32 on
the CPU the loader swaps the layers for their fused, pre-packed form (bert_cpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    """The config.json fields our encoder uses (model_type bert; others refused by `from_dict`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    num_labels: int = 1

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (one of {sorted(_ACTS)})")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        labels = d.get("id2label")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            max_position_embeddings=d["max_position_embeddings"],
            type_vocab_size=d.get("type_vocab_size", 2),
            layer_norm_eps=d.get("layer_norm_eps", 1e-12),
            hidden_act=d.get("hidden_act", "gelu"),
            pad_token_id=d.get("pad_token_id") or 0,
            num_labels=d.get("num_labels") or (len(labels) if labels else 1),
        )


@dataclass(frozen=True)
class _Packing:
    """Where a padded batch's real tokens are: `indices` int64 `[tokens]` into the flattened
    `[batch * seq]` positions."""

    indices: torch.Tensor
    batch: int
    seq: int

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, d]` -> `[tokens, d]`."""
        return x.reshape(self.batch * self.seq, x.shape[-1]).index_select(0, self.indices)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """`[tokens, d]` -> `[batch, seq, d]`, zeros at padded positions."""
        out = x.new_zeros(self.batch * self.seq, x.shape[-1])
        return out.index_copy_(0, self.indices, x).view(self.batch, self.seq, x.shape[-1])


_ACTS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, packing: _Packing | None) -> torch.Tensor:
        """x: `[batch, seq, hidden]`, or `[tokens, hidden]` packed when `packing` is given."""
        q, k, v = self.query(x), self.key(x), self.value(x)
        if packing is not None:
            q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
        b, s, h = q.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias)
        out = out.transpose(1, 2).reshape(b, s, h)
        return packing.pack(out) if packing is not None else out


class BertSelfOutput(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, packing: _Packing | None) -> torch.Tensor:
        return self.output(self.self(x, bias, packing), x)


class BertIntermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = _ACTS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.intermediate_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertOutput(c)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, packing: _Packing | None) -> torch.Tensor:
        a = self.attention(x, bias, packing)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, packing: _Packing | None = None
    ) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, bias, packing)
        return x


class BertPooler(nn.Module):
    """BERT's own pooler (dense + tanh over the first token): used by sequence classification heads."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """Encoder: `forward(input_ids, token_type_ids, attention_mask) -> [batch, seq, hidden]`."""

    def __init__(self, c: BertConfig, add_pooler: bool = False) -> None:
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c) if add_pooler else None

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        flat = attention_mask.reshape(-1)
        if bool(flat.all()):  # nothing to remove or mask: SDPA's unmasked path
            return self.encoder(x, None)
        # Additive key mask [batch, 1, 1, seq]: padded keys get the dtype's lowest value.
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        packing = _Packing(flat.nonzero().squeeze(1), x.shape[0], x.shape[1])
        return packing.unpack(self.encoder(packing.pack(x), bias, packing))


class BertForSequenceClassification(nn.Module):
    """Cross-encoder: BERT + pooler + linear head; `forward(...) -> logits [batch, num_labels]`."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.bert = BertModel(c, add_pooler=True)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.bert(input_ids, token_type_ids, attention_mask)
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(hidden))
