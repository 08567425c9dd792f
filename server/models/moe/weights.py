"""Expert weights stacked per block, and the loader helper from Hugging Face checkpoint names.

Our layout (vLLM's FusedMoE): `w13 [E, 2I, H]` holds each expert's gate rows then its up rows,
`w2 [E, H, I]` its down projection, so expert e computes
`down(act(x @ w13[e, :I].T, x @ w13[e, I:].T))` with `x @ w2[e].T` as the last GEMM.

Checkpoint layouts read (safetensors names under a block prefix such as `model.layers.0.mlp`):
- Mixtral: `block_sparse_moe.gate.weight [E, H]`, `experts.N.w1.weight` (gate, [I, H]),
  `experts.N.w3.weight` (up, [I, H]), `experts.N.w2.weight` (down, [H, I]);
- Qwen2-MoE / Qwen3-MoE: `gate.weight [E, H]`, `experts.N.{gate,up,down}_proj.weight`, and for Qwen2-MoE
  `shared_expert.{gate,up,down}_proj.weight` and `shared_expert_gate.weight [1, H]`;
- gpt-oss: `router.weight [E, H]`, `router.bias [E]`, `experts.gate_up_proj [E, H, 2I]` with gate and up
  interleaved along the last dimension (gate at even columns, as `GptOssExperts._apply_gate` slices),
  `experts.gate_up_proj_bias [E, 2I]` (interleaved too), `experts.down_proj [E, I, H]`,
  `experts.down_proj_bias [E, H]`. (MXFP4 checkpoints: server/models/moe/mxfp4.py.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from server.models.moe.config import MoEConfig


@dataclass(frozen=True)
class SharedExpertWeights:
    """Qwen2-MoE's always-on expert, gated by sigmoid(x @ gate.T). `w13` and `w2` are None (both) when
    the block holds the expert's GEMMs quantized (SparseMoeBlock.set_shared_expert); the gate stays."""

    w13: Tensor | None  # [2S, H] gate rows then up rows
    w2: Tensor | None  # [H, S]
    gate: Tensor  # [1, H]


@dataclass(frozen=True)
class ExpertWeights:
    """One block's dense expert weights, in one float dtype. Raises ValueError on a shape mismatch."""

    router: Tensor  # [E, H]
    router_bias: Tensor | None  # [E]
    w13: Tensor | None  # [E, 2I, H]; None when the experts are held quantized (moe/quant.py, moe/mxfp4.py)
    w2: Tensor | None  # [E, H, I]; None with w13
    b13: Tensor | None  # [E, 2I]
    b2: Tensor | None  # [E, H]
    shared: SharedExpertWeights | None = None

    def to(self, device: torch.device | str) -> ExpertWeights:
        """A copy with every tensor on `device`."""

        def mv(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        s = self.shared
        return ExpertWeights(
            self.router.to(device),
            mv(self.router_bias),
            mv(self.w13),
            mv(self.w2),
            mv(self.b13),
            mv(self.b2),
            None if s is None else SharedExpertWeights(mv(s.w13), mv(s.w2), s.gate.to(device)),
        )

    def check(self, cfg: MoEConfig) -> None:
        e, h, i, s = (
            cfg.num_experts,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.shared_expert_intermediate_size,
        )
        want: dict[str, tuple[Tensor | None, tuple[int, ...] | None]] = {
            "router": (self.router, (e, h)),
            "router_bias": (self.router_bias, (e,) if cfg.router_bias else None),
            "w13": (self.w13, (e, 2 * i, h) if self.w13 is not None else None),
            "w2": (self.w2, (e, h, i) if self.w13 is not None else None),
            "b13": (self.b13, (e, 2 * i) if cfg.expert_bias else None),
            "b2": (self.b2, (e, h) if cfg.expert_bias else None),
        }
        if s:
            if self.shared is None:
                raise ValueError("the config has a shared expert; weights.shared is missing")
            dense = self.shared.w13 is not None
            if dense != (self.shared.w2 is not None):
                raise ValueError("shared.w13 and shared.w2 are both given or both held quantized")
            want["shared.w13"] = (self.shared.w13, (2 * s, h) if dense else None)
            want["shared.w2"] = (self.shared.w2, (h, s) if dense else None)
            want["shared.gate"] = (self.shared.gate, (1, h))
        elif self.shared is not None:
            raise ValueError("weights.shared given but the config has no shared expert")
        for name, (t, shape) in want.items():
            if shape is None:
                if t is not None:
                    raise ValueError(f"{name} given but the config does not use it")
                continue
            if t is None or tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected {shape}, got {None if t is None else tuple(t.shape)}")


def _get(tensors: Mapping[str, Tensor], name: str) -> Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise KeyError(f"checkpoint tensor {name!r} missing") from None


def stack_gate_up(gates: list[Tensor], ups: list[Tensor]) -> Tensor:  # each [I, H] -> [E, 2I, H]
    return torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])


def deinterleave_gate_up(t: Tensor) -> Tensor:  # [..., 2I] (gate, up, gate, up, ...) -> [..., 2I] gate | up
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def load_expert_weights(
    tensors: Mapping[str, Tensor], prefix: str, cfg: MoEConfig, dense_experts: bool = True
) -> ExpertWeights:
    """Stacks one block's experts from checkpoint tensors named `{prefix}.{name}` (layouts in the module
    docstring; prefix e.g. `model.layers.3.block_sparse_moe` for Mixtral, `model.layers.3.mlp` else).
    With `dense_experts` False, w13 and w2 are left None (the experts come quantized; biases, router and
    shared expert are still read). Raises KeyError naming a missing tensor, ValueError on a shape mismatch."""
    p = f"{prefix}."
    e_range = range(cfg.num_experts)
    if cfg.model_type == "gpt_oss":
        w13 = w2 = None
        if dense_experts:
            w13 = deinterleave_gate_up(_get(tensors, p + "experts.gate_up_proj")).transpose(1, 2).contiguous()
            w2 = _get(tensors, p + "experts.down_proj").transpose(1, 2).contiguous()  # [E, I, H] -> [E, H, I]
        w = ExpertWeights(
            router=_get(tensors, p + "router.weight"),
            router_bias=_get(tensors, p + "router.bias"),
            w13=w13,
            w2=w2,
            b13=deinterleave_gate_up(_get(tensors, p + "experts.gate_up_proj_bias")).contiguous(),
            b2=_get(tensors, p + "experts.down_proj_bias"),
        )
    else:
        names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        experts = [
            [_get(tensors, f"{p}experts.{e}.{n}.weight") for n in names] for e in e_range if dense_experts
        ]
        shared = None
        if cfg.shared_expert_intermediate_size:
            sp = p + "shared_expert."
            shared = SharedExpertWeights(
                w13=torch.cat([_get(tensors, sp + "gate_proj.weight"), _get(tensors, sp + "up_proj.weight")]),
                w2=_get(tensors, sp + "down_proj.weight"),
                gate=_get(tensors, p + "shared_expert_gate.weight"),
            )
        w = ExpertWeights(
            router=_get(tensors, p + "gate.weight"),
            router_bias=None,
            w13=stack_gate_up([x[0] for x in experts], [x[1] for x in experts]) if dense_experts else None,
            w2=torch.stack([x[2] for x in experts]) if dense_experts else None,
            b13=None,
            b2=None,
            shared=shared,
        )
    w.check(cfg)
    return w
