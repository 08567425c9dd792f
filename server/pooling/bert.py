"""Our BERT-family encoder with Hugging Face's module names, so BertModel and
BertForSequenceClassification checkpoints load as they are.

Source of the algorithm: Devlin et al. 2018 / transformers' `modeling_bert.py` (post-LayerNorm blocks,
absolute position embeddings, exact-erf GELU). Inputs are padded batches: `input_ids`, `token_type_ids`
and `attention_mask` int64 `[batch, seq]`; outputs are `[batch, seq, hidden]` in the weights' dtype
(zeros at padded positions when the batch has padding).

Padding is removed inside the encoder: every op runs on the packed `[tokens, hidden]` real tokens only
(the unpadding of TEI / FlashAttention's varlen BERT). The packing orders rows by length, so rows of
one length lie back to back, and attention runs unmasked per run of equal-length rows on views of the
packed Q/K/V (`_Packing.attend`): no score or value product over padding, whose cost grows with the
longest row squared (a batch of texts of 8-40 words padded to its longest is ~40% padding; padded,
masked attention was ~30% of a 64-row step's CPU in bf16 GEMM mode). A batch with no padding (one
text, or texts of one length) runs as it is. In fp32 on
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
class _Run:
    """`rows` rows of `length` real tokens each, packed back to back from token `start`."""

    start: int
    rows: int
    length: int


@dataclass(frozen=True)
class _Packing:
    """Where a padded batch's real tokens are: `indices` int64 `[tokens]` into the flattened
    `[batch * seq]` positions, the rows ordered by length (longest first) so that rows of one length
    lie back to back (`runs`), each row's tokens in order."""

    indices: torch.Tensor
    batch: int
    seq: int
    runs: tuple[_Run, ...]

    @staticmethod
    def of(mask: torch.Tensor) -> _Packing:
        """The packing of an attention mask int `[batch, seq]` (1 = a real token)."""
        b, s = mask.shape
        lengths = mask.sum(1)
        order = torch.argsort(lengths, descending=True, stable=True)
        rows, cols = mask.index_select(0, order).nonzero(as_tuple=True)
        indices = order.index_select(0, rows) * s + cols
        runs: list[_Run] = []
        start = 0
        for n in lengths.index_select(0, order).tolist():
            if runs and runs[-1].length == n:
                runs[-1] = _Run(runs[-1].start, runs[-1].rows + 1, n)
            else:
                runs.append(_Run(start, 1, n))
            start += n
        return _Packing(indices, b, s, tuple(runs))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, d]` -> `[tokens, d]`."""
        return x.reshape(self.batch * self.seq, x.shape[-1]).index_select(0, self.indices)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """`[tokens, d]` -> `[batch, seq, d]`, zeros at padded positions."""
        out = x.new_zeros(self.batch * self.seq, x.shape[-1])
        return out.index_copy_(0, self.indices, x).view(self.batch, self.seq, x.shape[-1])

    def attend(self, qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Self-attention within each row over packed tokens: qkv `[tokens, 3 * hidden]` (Q, K, V side
        by side) -> `[tokens, hidden]`. One unmasked SDPA per run of equal-length rows, on views of
        the packed tokens: no padding, no mask, no copy in (varlen attention as TEI's BERT and
        FlashAttention's `varlen` do; on the CPU a padded, masked SDPA costs ~(longest row)^2 per row
        and was ~30% of a 64-row step here)."""
        t, h = qkv.shape[0], qkv.shape[1] // 3
        hd = h // num_heads
        out = qkv.new_empty(t, h)
        for r in self.runs:
            span = slice(r.start, r.start + r.rows * r.length)
            q, k, v = qkv[span].view(r.rows, r.length, 3, num_heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v)  # [rows, heads, length, hd]
            out[span].view(r.rows, r.length, num_heads, hd).copy_(a.transpose(1, 2))
        return out


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

    def forward(self, x: torch.Tensor, packing: _Packing | None) -> torch.Tensor:
        """x: `[batch, seq, hidden]` (no padding), or `[tokens, hidden]` packed when `packing` is given."""
        q, k, v = self.query(x), self.key(x), self.value(x)
        if packing is not None:
            return packing.attend(torch.cat([q, k, v], dim=-1), self.num_heads)
        b, s, h = q.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        return out.transpose(1, 2).reshape(b, s, h)


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

    def forward(self, x: torch.Tensor, packing: _Packing | None) -> torch.Tensor:
        return self.output(self.self(x, packing), x)


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

    def forward(self, x: torch.Tensor, packing: _Packing | None) -> torch.Tensor:
        a = self.attention(x, packing)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: torch.Tensor, packing: _Packing | None = None) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, packing)
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
            return self.encoder(x)
        packing = _Packing.of(attention_mask)
        return packing.unpack(self.encoder(packing.pack(x), packing))


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
