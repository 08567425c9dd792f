"""Megatron-style sharding of an already-loaded `LlamaForCausalLM` (Shoeybi et al. 2019, "Megatron-LM").

q/k/v and gate/up are column-parallel (each rank keeps its heads / its slice of the intermediate size),
o and down are row-parallel (one all-reduce each per layer), the embedding and the LM head are
vocab-parallel (an all-reduce after the embedding, an all-gather of the logits). Attention heads split
evenly; KV heads split when N divides them and are replicated when N is a multiple of them (rank r
keeps KV head r * Hkv // N, the one its query heads read), so each rank's KV cache holds only its own
KV heads and block tables stay global.

Mixture-of-experts layers (Mixtral, Qwen2/3-MoE, gpt-oss) split each expert's intermediate dimension
(server/distributed/moe_sharding.py: one all-reduce per block, the router replicated); gpt-oss's
attention sinks, one per query head, follow their heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from server.distributed.moe_sharding import (
    TensorParallelSparseMoeBlock,
    check_block_shardable,
    validate_moe_split,
)
from server.distributed.parallel_state import TensorParallelConfigError
from server.models.arch import ArchConfig
from server.models.layer_spec import LayerSpec
from server.models.layers import TokenEmbedding
from server.models.llama import LlamaForCausalLM
from server.models.loader import TensorSlicer, read_hf_config
from server.models.moe import SparseMoeBlock
from server.models.registry import arch_from_hf
from server.quant import cpu_repack
from server.quant.layers import Int8Linear

__all__ = [
    "RowParallelLinear",
    "ShardSpec",
    "TensorParallelConfigError",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "check_shardable",
    "checkpoint_slicer",
    "rank_loading",
    "rank_loading_slicer",
    "shard_model",
    "shard_spec",
    "validate_tensor_parallel",
]


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


def _shardable_layer(spec: LayerSpec, head_dim: int) -> bool:
    """The Llama layer up to what splits per head or per expert alike: a MoE MLP, a sliding window
    (each rank's heads see the same window), attention sinks (one per query head, cut with them)."""
    return dataclasses.replace(spec, mlp="dense", sliding_window=None, attn_sinks=False).is_llama(head_dim)


def tensor_parallel_shardable(cfg: ArchConfig) -> bool:
    """Whether `shard_model` can split this architecture: Llama/Qwen layers, dense or mixture of experts
    (Mixtral, Qwen2/3-MoE, gpt-oss), with nothing model-level that differs from Llama's."""
    return (
        all(_shardable_layer(spec, cfg.head_dim) for spec in cfg.layers)
        and cfg.embedding_multiplier == 1.0
        and cfg.logits_divisor == 1.0
        and cfg.final_logit_softcap is None
        and cfg.final_norm == "rms"
    )


def validate_tensor_parallel(cfg: ArchConfig, world_size: int) -> None:
    """Raises TensorParallelConfigError unless heads, KV heads and the (dense and expert) intermediate
    sizes split over N ranks."""
    n = world_size
    if n > 1 and not tensor_parallel_shardable(cfg):
        raise TensorParallelConfigError(
            f"tensor parallelism shards the Llama layer only (its MLP dense or a mixture of experts); "
            f"{cfg.architecture} layers (docs/models.md) are served on one device"
        )
    if cfg.num_heads % n:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {n} must divide the number of attention heads ({cfg.num_heads})"
        )
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {n} must divide the number of KV heads ({cfg.num_kv_heads}) "
            f"or be a multiple of it (KV heads are then replicated)"
        )
    if cfg.moe is not None:
        validate_moe_split(cfg.moe, n)
    if any(spec.mlp == "dense" for spec in cfg.layers) and cfg.intermediate_size % n:
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


def rank_loading(world_size: int) -> contextlib.AbstractContextManager[None]:
    """The context a rank loads its model in: under tensor parallelism (world_size > 1), int8 loads as
    `Int8Linear` (the layout `shard_model` cuts along rows/columns with their scales), not as the CPU
    weight-only kernel's repacked `BlockQuantLinear` (cpu_repack.py), which is not sharded yet."""
    return cpu_repack.previous_cpu_path() if world_size > 1 else contextlib.nullcontext()


def _shardable(m: nn.Module, what: str) -> nn.Linear | Int8Linear:
    if type(m) is not nn.Linear and not isinstance(m, Int8Linear):
        raise TensorParallelConfigError(
            f"tensor parallelism shards dense and int8 (per-channel) weights only for now; {what} is "
            f"{type(m).__name__}"
        )
    return m


def _cut(t: Tensor, dim: int, start: int, end: int, full: int, what: str) -> Tensor:
    """`t` narrowed to [start, end) along `dim`: `t` is the whole tensor (size `full` there) or already
    that slice (per-rank loading read only it)."""
    size = t.shape[dim]
    if size == end - start:
        return t.contiguous()
    if size != full:
        raise TensorParallelConfigError(
            f"{what}: size {size} along dim {dim} is neither {full} nor {end - start}"
        )
    return t.narrow(dim, start, end - start).contiguous()


def _int8_scale(m: Int8Linear) -> Tensor:  # [N] fp32 (a bf16 scale converts back exactly)
    scale = m.scale_f32 if m.scale is None else m.scale.float()
    assert scale is not None
    return scale


def _column_parallel(m: nn.Module, start: int, end: int, full: int, what: str) -> nn.Module:
    """Keep output features [start, end): rows of the weight, their int8 scales, their bias."""
    lin = _shardable(m, what)
    bias = None if lin.bias is None else _cut(lin.bias.detach(), 0, start, end, full, what)
    if isinstance(lin, Int8Linear):
        qweight = _cut(lin.qweight, 0, start, end, full, what)
        return Int8Linear(qweight, _cut(_int8_scale(lin), 0, start, end, full, what), bias)
    w = _cut(lin.weight.detach(), 0, start, end, full, what)  # [out / N, in]
    out = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out.requires_grad_(False)


class RowParallelLinear(nn.Module):
    """Keeps input features [start, end) of a Linear (int8: those columns of the weight with every
    output channel's full scale, so each partial product is exact); the partial products are summed by
    one all-reduce. The bias is added once (on rank 0, before the sum)."""

    def __init__(self, m: nn.Module, start: int, end: int, full: int, rank: int, what: str) -> None:
        super().__init__()
        lin = _shardable(m, what)
        bias = lin.bias.detach().clone() if lin.bias is not None and rank == 0 else None
        self.linear: nn.Module
        if isinstance(lin, Int8Linear):
            self.linear = Int8Linear(_cut(lin.qweight, 1, start, end, full, what), _int8_scale(lin), bias)
        else:
            w = _cut(lin.weight.detach(), 1, start, end, full, what)  # [out, in / N]
            linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
            linear.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias, requires_grad=False)
            self.linear = linear.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, in / N] -> [T, out], summed over ranks
        y = self.linear(x)
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rank r keeps embedding rows [start, end); ids outside contribute zeros, one all-reduce sums them
    (exact: one rank holds each id)."""

    def __init__(self, weight: Tensor, start: int, end: int, vocab_size: int) -> None:
        # weight: [vocab, hidden] or already rows [start, end)
        super().__init__()
        self.start, self.end = start, end
        w = _cut(weight.detach(), 0, start, end, vocab_size, "embed_tokens")
        self.weight = nn.Parameter(w, requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:  # ids: [T] int64 -> [T, hidden]
        inside = (ids >= self.start) & (ids < self.end)  # [T] bool
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        h = F.embedding(local, self.weight) * inside[:, None].to(self.weight.dtype)
        dist.all_reduce(h)
        return h


class VocabParallelLMHead(nn.Module):
    """Rank r computes the logits of vocabulary rows [start, end); an all-gather gives every rank the
    full [N, vocab] logits (rank 0 samples from them)."""

    def __init__(self, weight: Tensor, spec: ShardSpec, vocab_size: int) -> None:
        # weight: [vocab, hidden] or already rows spec.vocab
        super().__init__()
        start, end = spec.vocab
        w = _cut(weight.detach(), 0, start, end, vocab_size, "lm_head")
        self.linear = nn.Linear(w.shape[1], end - start, bias=False, device="meta")
        self.linear.weight = nn.Parameter(w, requires_grad=False)
        self.shard, self.vocab_size, self.world_size = spec.vocab_shard, vocab_size, spec.world_size

    def forward(self, h: Tensor) -> Tensor:  # h: [N, hidden] -> [N, vocab]
        local = self.linear(h)  # [N, end - start]
        if local.shape[1] < self.shard:  # the last rank's slice is short when N does not divide vocab
            local = F.pad(local, (0, self.shard - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


# Checkpoint tensor names (Hugging Face Llama/Qwen2) -> which ShardSpec range, along which dim.
_COLUMN = {
    "q_proj": "heads",
    "k_proj": "kv_heads",
    "v_proj": "kv_heads",
    "gate_proj": "inter",
    "up_proj": "inter",
}
_ROW = {"o_proj": "heads", "down_proj": "inter"}


def checkpoint_slicer(cfg: ArchConfig, spec: ShardSpec, quantize_on_load: bool) -> TensorSlicer:
    """What rank `spec.rank` reads of each checkpoint tensor (per-rank loading, `load_model(slicer=)`):
    column-parallel weights and biases their output rows, row-parallel weights their input columns,
    the embedding and the LM head their vocabulary rows; norms and row-parallel biases whole.
    `quantize_on_load` (--quantize int8): row-parallel weights are read whole, because an output
    channel's int8 scale spans the whole row; `shard_model` cuts them after quantization.
    Mixture-of-experts layers' MLP tensors are read whole (per-expert names and gpt-oss's stacked or
    packed ones; `shard_model` cuts them once the block has stacked them)."""
    d = cfg.head_dim
    moe_prefixes = tuple(
        f"model.layers.{n}.{block}."
        for n, spec in enumerate(cfg.layers)
        if spec.mlp == "moe"
        for block in ("mlp", "block_sparse_moe")
    )
    ranges = {
        "heads": (spec.heads[0] * d, spec.heads[1] * d),
        "kv_heads": (spec.kv_heads[0] * d, spec.kv_heads[1] * d),
        "inter": spec.intermediate,
    }

    def slicer(name: str) -> tuple[int, int, int] | None:
        parts = name.split(".")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *spec.vocab)
        if len(parts) < 2 or parts[-1] not in ("weight", "bias") or name.startswith(moe_prefixes):
            return None
        proj = parts[-2]
        if proj in _COLUMN:
            return (0, *ranges[_COLUMN[proj]])
        if proj in _ROW and parts[-1] == "weight" and not quantize_on_load:
            return (1, *ranges[_ROW[proj]])
        return None

    return slicer


def rank_loading_slicer(folder: Path, quantize: str | None, rank: int, world_size: int) -> TensorSlicer:
    """The slicer rank `rank` loads the checkpoint in `folder` with (see `checkpoint_slicer`). Raises
    TensorParallelConfigError, before anything is read or started, for shapes that do not split and for
    quantization other than on-the-fly int8 (pre-quantized checkpoints, --quantize int4/fp8/GGUF
    blocks/bitsandbytes keep their own packed layouts, not sharded yet)."""
    hf_cfg = read_hf_config(folder)
    packed = hf_cfg.get("quantization_config")
    method = packed.get("quant_method", "?") if isinstance(packed, dict) else "?"
    # gpt-oss ships its experts in MXFP4 (the rest dense): the packed experts split per rank
    mxfp4_experts = method == "mxfp4" and hf_cfg.get("model_type") == "gpt_oss"
    if packed and not mxfp4_experts:
        raise TensorParallelConfigError(
            f"tensor parallelism cannot shard a pre-quantized checkpoint ({method}) yet: use a dense "
            "checkpoint, optionally with --quantize int8"
        )
    if quantize not in (None, "int8"):
        raise TensorParallelConfigError(
            f"tensor parallelism shards dense and int8 (per-channel) weights only for now; "
            f"--quantize {quantize} is not supported with --tensor-parallel-size > 1"
        )
    cfg = arch_from_hf(hf_cfg)
    if mxfp4_experts and cfg.moe is not None:
        validate_moe_split(cfg.moe, world_size, mxfp4=True)
    return checkpoint_slicer(cfg, shard_spec(cfg, rank, world_size), quantize_on_load=quantize is not None)


def check_shardable(model: LlamaForCausalLM, world_size: int) -> None:
    """Raises TensorParallelConfigError before any process starts if `shard_model` would refuse."""
    validate_tensor_parallel(model.config, world_size)
    for n, layer in enumerate(model.decoder_layers()):
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _shardable(getattr(attn, name, None), f"layer {n} {name}")  # type: ignore[arg-type]
        if layer.spec.mlp == "moe":
            check_block_shardable(mlp, world_size, f"layer {n} mlp")
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            _shardable(getattr(mlp, name, None), f"layer {n} {name}")  # type: ignore[arg-type]
    if type(model.lm_head) is not nn.Linear or type(model.model.embed_tokens) not in (
        nn.Embedding,
        TokenEmbedding,
    ):
        raise TensorParallelConfigError(
            "tensor parallelism shards a dense embedding and LM head only; got "
            f"{type(model.model.embed_tokens).__name__} / {type(model.lm_head).__name__}"
        )


def shard_model(model: LlamaForCausalLM, rank: int, world_size: int) -> ShardSpec:
    """Replaces the model's projections, embedding and LM head by this rank's shards, in place.

    Call after loading and before `prepare_for_serving` (which then fuses and packs the local Linears).
    Each weight may be whole (it is cut here) or already this rank's slice (`checkpoint_slicer`).
    `model.config` becomes the per-rank shape (local heads, KV heads, intermediate size), so the KV cache
    built from it holds [num_blocks, block_size, local KV heads, head_dim] per layer. Needs the default
    process group. Raises TensorParallelConfigError for shapes that do not split or quantized layers
    other than int8 (Int8Linear: rows with their scales, or columns with every row's full scale).
    """
    cfg = model.config
    spec = shard_spec(cfg, rank, world_size)
    check_shardable(model, world_size)
    d = cfg.head_dim
    (h0, h1), (k0, k1), (i0, i1) = spec.heads, spec.kv_heads, spec.intermediate
    hq, hkv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    for n, layer in enumerate(model.decoder_layers()):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None or getattr(mlp, "gate_up_proj", None) is not None:
            raise TensorParallelConfigError("shard the model before prepare_for_serving fuses its weights")
        where = f"layer {n}"
        attn.q_proj = _column_parallel(attn.q_proj, h0 * d, h1 * d, hq, f"{where} q_proj")  # type: ignore[assignment]
        attn.k_proj = _column_parallel(attn.k_proj, k0 * d, k1 * d, hkv, f"{where} k_proj")  # type: ignore[assignment]
        attn.v_proj = _column_parallel(attn.v_proj, k0 * d, k1 * d, hkv, f"{where} v_proj")  # type: ignore[assignment]
        attn.o_proj = RowParallelLinear(attn.o_proj, h0 * d, h1 * d, hq, rank, f"{where} o_proj")  # type: ignore[assignment]
        attn.num_heads, attn.num_kv_heads = h1 - h0, k1 - k0
        if attn.sinks is not None:
            attn.sinks = nn.Parameter(_cut(attn.sinks.detach(), 0, h0, h1, cfg.num_heads, f"{where} sinks"))
        if isinstance(mlp, SparseMoeBlock):
            layer.mlp = TensorParallelSparseMoeBlock.from_block(mlp, rank, world_size)
            continue
        mlp.gate_proj = _column_parallel(mlp.gate_proj, i0, i1, inter, f"{where} gate_proj")  # type: ignore[assignment]
        mlp.up_proj = _column_parallel(mlp.up_proj, i0, i1, inter, f"{where} up_proj")  # type: ignore[assignment]
        mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i1, inter, rank, f"{where} down_proj")  # type: ignore[assignment]
    embed = model.model.embed_tokens
    head = model.lm_head
    model.lm_head = VocabParallelLMHead(head.weight, spec, cfg.vocab_size)  # type: ignore[assignment]
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight, *spec.vocab, cfg.vocab_size)  # type: ignore[assignment]
    local_moe = None
    if cfg.moe is not None:
        inter_moe, shared = cfg.moe.intermediate_size, cfg.moe.shared_expert_intermediate_size
        local_moe = dataclasses.replace(
            cfg.moe,
            intermediate_size=inter_moe // world_size,
            shared_expert_intermediate_size=shared // world_size,
        )
    model.config = dataclasses.replace(
        cfg, num_heads=h1 - h0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0, moe=local_moe
    )
    return spec
