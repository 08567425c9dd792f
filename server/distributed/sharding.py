"""Megatron-style sharding of an already-loaded `LlamaForCausalLM` (Shoeybi et al. 2019, "Megatron-LM").

q/k/v and gate/up are column-parallel (each rank keeps its heads / its slice of the intermediate size),
o and down are row-parallel (one all-reduce each per layer), the embedding and the LM head are
vocab-parallel (an all-reduce after the embedding, an all-gather of the logits). Attention heads split
evenly; KV heads split when N divides them and are replicated when N is a multiple of them (rank r
keeps KV head r * Hkv // N, the one its query heads read), so each rank's KV cache holds only its own
KV heads and block tables stay global.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from server.models.arch import ArchConfig
from server.models.llama import LlamaForCausalLM


class TensorParallelConfigError(ValueError):
    """The model's shape cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class ShardSpec:
    """Which part of the model rank `rank` of `world_size` keeps."""

    rank: int
    world_size: int
    heads: tuple[int, int]  # [start, end) query heads
    kv_heads: tuple[int, int]  # [start, end) KV heads
    intermediate: tuple[int, int]  # [start, end) MLP intermediate channels
    vocab: tuple[int, int]  # [start, end) vocabulary rows (end - start may be < vocab_shard)
    vocab_shard: int  # ceil(vocab / world_size): every rank's padded logits width


def validate_tensor_parallel(cfg: ArchConfig, world_size: int) -> None:
    """Raises TensorParallelConfigError unless heads, KV heads and intermediate size split over N ranks."""
    n = world_size
    if cfg.num_heads % n:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {n} must divide the number of attention heads ({cfg.num_heads})"
        )
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {n} must divide the number of KV heads ({cfg.num_kv_heads}) "
            f"or be a multiple of it (KV heads are then replicated)"
        )
    if cfg.intermediate_size % n:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {n} must divide the MLP intermediate size ({cfg.intermediate_size})"
        )
    if cfg.vocab_size < n:
        raise TensorParallelConfigError(f"vocabulary ({cfg.vocab_size}) is smaller than {n} ranks")


def shard_spec(cfg: ArchConfig, rank: int, world_size: int) -> ShardSpec:
    validate_tensor_parallel(cfg, world_size)
    n, r = world_size, rank
    hq = cfg.num_heads // n
    if cfg.num_kv_heads >= n:
        hkv = cfg.num_kv_heads // n
        kv = (r * hkv, (r + 1) * hkv)
    else:
        kv_index = r * cfg.num_kv_heads // n
        kv = (kv_index, kv_index + 1)
    i = cfg.intermediate_size // n
    vs = -(-cfg.vocab_size // n)
    return ShardSpec(
        rank=r,
        world_size=n,
        heads=(r * hq, (r + 1) * hq),
        kv_heads=kv,
        intermediate=(r * i, (r + 1) * i),
        vocab=(min(r * vs, cfg.vocab_size), min((r + 1) * vs, cfg.vocab_size)),
        vocab_shard=vs,
    )


def _plain_linear(m: nn.Module, what: str) -> nn.Linear:
    if type(m) is not nn.Linear:
        raise TensorParallelConfigError(
            f"tensor parallelism shards dense weights only for now; {what} is {type(m).__name__}"
        )
    return m


def _rows(m: nn.Module, start: int, end: int, what: str) -> nn.Linear:
    """Column-parallel: keep output features [start, end)."""
    lin = _plain_linear(m, what)
    w = lin.weight.detach()  # [out, in]
    out = nn.Linear(w.shape[1], end - start, bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    out.weight.data = w[start:end].clone()
    if lin.bias is not None:
        out.bias.data = lin.bias.detach()[start:end].clone()  # type: ignore[union-attr]
    return out.requires_grad_(False)


class RowParallelLinear(nn.Module):
    """Keeps input features [start, end) of a Linear; the partial products are summed by one all-reduce.
    The bias is added once (on rank 0, before the sum)."""

    def __init__(self, m: nn.Module, start: int, end: int, rank: int, what: str) -> None:
        super().__init__()
        lin = _plain_linear(m, what)
        w = lin.weight.detach()  # [out, in]
        keep_bias = lin.bias is not None and rank == 0
        self.linear = nn.Linear(end - start, w.shape[0], bias=keep_bias, device=w.device, dtype=w.dtype)
        self.linear.weight.data = w[:, start:end].clone()
        if keep_bias:
            self.linear.bias.data = lin.bias.detach().clone()  # type: ignore[union-attr]
        self.linear.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, in / N] -> [T, out], summed over ranks
        y = self.linear(x)
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rank r keeps embedding rows [start, end); ids outside contribute zeros, one all-reduce sums them
    (exact: one rank holds each id)."""

    def __init__(self, weight: Tensor, start: int, end: int) -> None:  # weight: [vocab, hidden]
        super().__init__()
        self.start, self.end = start, end
        self.weight = nn.Parameter(weight.detach()[start:end].clone(), requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:  # ids: [T] int64 -> [T, hidden]
        inside = (ids >= self.start) & (ids < self.end)  # [T] bool
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        h = F.embedding(local, self.weight) * inside[:, None].to(self.weight.dtype)
        dist.all_reduce(h)
        return h


class VocabParallelLMHead(nn.Module):
    """Rank r computes the logits of vocabulary rows [start, end); an all-gather gives every rank the
    full [N, vocab] logits (rank 0 samples from them)."""

    def __init__(self, weight: Tensor, spec: ShardSpec, vocab_size: int) -> None:  # weight: [vocab, hidden]
        super().__init__()
        start, end = spec.vocab
        w = weight.detach()
        self.linear = nn.Linear(w.shape[1], end - start, bias=False, device=w.device, dtype=w.dtype)
        self.linear.weight.data = w[start:end].clone()
        self.linear.requires_grad_(False)
        self.shard, self.vocab_size, self.world_size = spec.vocab_shard, vocab_size, spec.world_size

    def forward(self, h: Tensor) -> Tensor:  # h: [N, hidden] -> [N, vocab]
        local = self.linear(h)  # [N, end - start]
        if local.shape[1] < self.shard:  # the last rank's slice is short when N does not divide vocab
            local = F.pad(local, (0, self.shard - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


def check_shardable(model: LlamaForCausalLM, world_size: int) -> None:
    """Raises TensorParallelConfigError before any process starts if `shard_model` would refuse."""
    validate_tensor_parallel(model.config, world_size)
    for n, layer in enumerate(model.decoder_layers()):
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _plain_linear(getattr(attn, name, None), f"layer {n} {name}")  # type: ignore[arg-type]
        for name in ("gate_proj", "up_proj", "down_proj"):
            _plain_linear(getattr(mlp, name, None), f"layer {n} {name}")  # type: ignore[arg-type]
    _plain_linear(model.lm_head, "lm_head")


def shard_model(model: LlamaForCausalLM, rank: int, world_size: int) -> ShardSpec:
    """Replaces the model's projections, embedding and LM head by this rank's shards, in place.

    Call after loading and before `prepare_for_serving` (which then fuses and packs the local Linears).
    `model.config` becomes the per-rank shape (local heads, KV heads, intermediate size), so the KV cache
    built from it holds [num_blocks, block_size, local KV heads, head_dim] per layer. Needs the default
    process group. Raises TensorParallelConfigError for shapes that do not split or quantized layers.
    """
    cfg = model.config
    spec = shard_spec(cfg, rank, world_size)
    d = cfg.head_dim
    (h0, h1), (k0, k1), (i0, i1) = spec.heads, spec.kv_heads, spec.intermediate
    for n, layer in enumerate(model.decoder_layers()):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
            raise TensorParallelConfigError("shard the model before prepare_for_serving fuses its weights")
        attn.q_proj = _rows(attn.q_proj, h0 * d, h1 * d, f"layer {n} q_proj")
        attn.k_proj = _rows(attn.k_proj, k0 * d, k1 * d, f"layer {n} k_proj")
        attn.v_proj = _rows(attn.v_proj, k0 * d, k1 * d, f"layer {n} v_proj")
        attn.o_proj = RowParallelLinear(attn.o_proj, h0 * d, h1 * d, rank, f"layer {n} o_proj")  # type: ignore[assignment]
        attn.num_heads, attn.num_kv_heads = h1 - h0, k1 - k0
        mlp.gate_proj = _rows(mlp.gate_proj, i0, i1, f"layer {n} gate_proj")
        mlp.up_proj = _rows(mlp.up_proj, i0, i1, f"layer {n} up_proj")
        mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i1, rank, f"layer {n} down_proj")  # type: ignore[assignment]
    embed = model.model.embed_tokens
    head = _plain_linear(model.lm_head, "lm_head")
    model.lm_head = VocabParallelLMHead(head.weight, spec, cfg.vocab_size)  # type: ignore[assignment]
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight, *spec.vocab)  # type: ignore[assignment]
    model.config = dataclasses.replace(
        cfg, num_heads=h1 - h0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0
    )
    return spec
