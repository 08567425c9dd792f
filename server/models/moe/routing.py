"""Router logits -> top-k experts and their weights; token-expert pairs grouped by expert.

Ties: our logits are the same F.linear of the same tensors as transformers' routers and both call
`torch.topk`, so the choices are the same bit for bit, ties included. torch.topk promises no order among
equal values (on CPU tests/moe/test_moe_decode_graph.py saw [12, 3, 9] for three equal ones); the decode
graph's own top-k (cpu_fused.cpp's moe_route) takes exact ties lowest index first; random weights make
exact ties vanishingly rare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from server.models.moe.config import MoEConfig


@dataclass(frozen=True)
class Routing:
    """The experts chosen per token and their weights."""

    weights: Tensor  # [T, top_k] fp32, the weight of each chosen expert's output
    ids: Tensor  # [T, top_k] int64, expert index in [0, E)


def select_experts(logits: Tensor, cfg: MoEConfig) -> Routing:  # logits: [T, E], any float dtype
    """Top-k selection as the model's own router does it (see MoEConfig's docstring)."""
    if logits.dim() != 2 or logits.shape[1] != cfg.num_experts:
        raise ValueError(f"logits must be [T, {cfg.num_experts}], got {tuple(logits.shape)}")
    if cfg.routing == "topk_softmax":
        top, ids = torch.topk(logits, cfg.top_k, dim=-1)
        # gpt-oss's router softmaxes in the logits' dtype; fp32 here matches it for fp32 models.
        return Routing(torch.softmax(top.float(), dim=-1), ids)
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(top, ids)


@dataclass(frozen=True)
class ExpertGroups:
    """The T * top_k token-expert pairs sorted by expert (stable: token order within an expert)."""

    pairs: Tensor  # [T * top_k] int64, pair index p (token p // top_k, slot p % top_k), grouped by expert
    tokens: Tensor  # [T * top_k] int64, pairs // top_k
    counts: list[int]  # [E], pairs per expert; expert e owns pairs[offsets[e]:offsets[e] + counts[e]]
    offsets: list[int]  # [E]


def group_by_expert(ids: Tensor, num_experts: int) -> ExpertGroups:  # ids: [T, top_k] int64
    """One stable sort of the flattened pairs; counts come back to the host once (a Python list) since
    the per-expert GEMM loop needs them."""
    flat = ids.reshape(-1)
    pairs = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    offsets = [0] * num_experts
    for e in range(1, num_experts):
        offsets[e] = offsets[e - 1] + counts[e - 1]
    return ExpertGroups(pairs, pairs // ids.shape[1], counts, offsets)
