"""SparseMoeBlock: the decoder layer's MLP when its `LayerSpec.mlp` is "moe" (server/models/layers.py).

The block's tensors are module parameters under our own names, one per `ExpertWeights` field
(`router [E, H]`, `router_bias [E]`, `w13 [E, 2I, H]`, `w2 [E, H, I]`, `b13 [E, 2I]`, `b2 [E, H]`,
`shared_w13 [2S, H]`, `shared_w2 [H, S]`, `shared_gate [1, H]`), so the model is built on the meta
device and filled by `load_state_dict(assign=True)` like every other layer; `stack_checkpoint_experts`
turns a checkpoint's per-expert tensors into those names. None of them is an `nn.Linear`: `--quantize`,
LoRA and the projection fusion (which find projections by module name and class) leave the block alone.
The computation is `FusedMoE` over those tensors (built once per set of tensors), or over `experts`
when the loader gives the block quantized expert GEMMs instead of `w13`/`w2`; likewise the shared
expert's GEMMs may be two quantized projections (`shared_gate_up [2S, H]`, `shared_down [H, S]`,
submodules, so the engine's GEMM dtype, weight accounting and the decode graph reach them as they reach
every other projection) in place of `shared_w13`/`shared_w2`: a GGUF's `ffn_*_shexp` kept in their
blocks, or `--quantize`'s format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from server.models.moe.config import MoEConfig
from server.models.moe.layer import DenseExperts, ExpertGemms, FusedMoE
from server.models.moe.weights import ExpertWeights, SharedExpertWeights, load_expert_weights

# ExpertWeights field -> our parameter name(s) under the block's prefix
_OPTIONAL = ("router_bias", "b13", "b2")


class SparseMoeBlock(nn.Module):
    """forward(x [T, H]) -> [T, H] in x's dtype. Dense experts multiply in their parameters' dtype
    (the model's `--dtype`: fp32 keeps fp32 GEMMs, so parity with transformers' fp32 holds)."""

    def __init__(self, cfg: MoEConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        e, h, i, s = (
            cfg.num_experts,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.shared_expert_intermediate_size,
        )

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, device=device), requires_grad=False)

        self.router = param(e, h)
        self.w13: nn.Parameter | None = param(e, 2 * i, h)
        self.w2: nn.Parameter | None = param(e, h, i)
        # optional tensors: a plain None attribute where the config has none (no state-dict entry)
        self.router_bias: nn.Parameter | None = param(e) if cfg.router_bias else None
        self.b13: nn.Parameter | None = param(e, 2 * i) if cfg.expert_bias else None
        self.b2: nn.Parameter | None = param(e, h) if cfg.expert_bias else None
        self.shared_w13: nn.Parameter | None = param(2 * s, h) if s else None
        self.shared_w2: nn.Parameter | None = param(h, s) if s else None
        self.shared_gate: nn.Parameter | None = param(1, h) if s else None
        # Quantized expert GEMMs (GGUF K-quants, MXFP4, int8) set by the loader in place of w13 / w2.
        self.experts: ExpertGemms | None = None
        # The shared expert's quantized projections (set_shared_expert) in place of shared_w13 / shared_w2
        self.shared_gate_up: nn.Module | None = None
        self.shared_down: nn.Module | None = None
        self._fused: tuple[tuple[object, ...], FusedMoE] | None = None

    def set_gemm_dtype(self, dtype: torch.dtype) -> int:
        """quant/gemm_dtype.apply_gemm_dtype's hook (`FollowsGemmDtype`): quantized experts that take a
        compute dtype follow the engine's (BlockQuantExperts); dense experts keep their parameters'
        dtype, MXFP4 its kernel's. Returns the expert sets set (0 or 1)."""
        set_dtype = getattr(self.experts, "set_gemm_dtype", None)
        return 0 if set_dtype is None else int(set_dtype(dtype))

    def set_experts(self, experts: ExpertGemms) -> None:
        """Serve the experts through `experts` (quantized); w13 and w2 are dropped."""
        self.experts = experts
        self.w13 = None
        self.w2 = None
        self._fused = None

    def set_shared_expert(self, gate_up: nn.Module, down: nn.Module) -> None:
        """Serve the shared expert through two projections (BlockQuantLinear: x [T, H] fp32 -> [T, 2S]
        fp32 gate | up; [T, S] -> [T, H]); shared_w13 and shared_w2 are dropped, shared_gate stays.
        Raises ValueError for a block without a shared expert or projections of other sizes."""
        s, h = self.cfg.shared_expert_intermediate_size, self.cfg.hidden_size
        if not s:
            raise ValueError("this block has no shared expert")
        got = [(getattr(m, "in_features", None), getattr(m, "out_features", None)) for m in (gate_up, down)]
        if got != [(h, 2 * s), (s, h)]:
            raise ValueError(f"shared expert projections must be [{2 * s}, {h}] and [{h}, {s}], got {got}")
        self.shared_gate_up, self.shared_down = gate_up, down
        self.shared_w13 = None
        self.shared_w2 = None
        self._fused = None

    def held_weight_tensors(self) -> list[Tensor]:
        """The quantized experts' tensors (not parameters), for server.quant.weight_bytes."""
        tensors = getattr(self.experts, "tensors", None)
        return list(tensors()) if callable(tensors) else []

    def expert_weights(self) -> ExpertWeights:
        def opt(name: str) -> Tensor | None:
            t = getattr(self, name)
            return None if t is None else t.data

        shared = None
        if self.shared_gate is not None:
            shared = SharedExpertWeights(opt("shared_w13"), opt("shared_w2"), self.shared_gate.data)
        return ExpertWeights(
            router=self.router.data,
            router_bias=opt("router_bias"),
            w13=opt("w13"),
            w2=opt("w2"),
            b13=opt("b13"),
            b2=opt("b2"),
            shared=shared,
        )

    def fused(self) -> FusedMoE:
        """The FusedMoE over the current tensors (rebuilt when they were replaced or moved)."""
        key = (
            *((t.data_ptr(), t.dtype, t.device) for t in self.parameters()),
            id(self.experts),
            id(self.shared_gate_up),
        )
        if self._fused is None or self._fused[0] != key:
            w = self.expert_weights()
            experts = self.experts
            if experts is None:
                assert w.w13 is not None
                experts = DenseExperts(w, gemm_dtype=w.w13.dtype)
            shared = None
            if self.shared_gate_up is not None and self.shared_down is not None:
                shared = _SharedProjections(self.shared_gate_up, self.shared_down)
            self._fused = (key, FusedMoE(self.cfg, w, experts=experts, shared_gemms=shared))
        return self._fused[1]

    def forward(self, x: Tensor) -> Tensor:  # x: [..., hidden] -> the same shape
        # tokens are independent: the pooling decoder's [B, S, hidden] batches flatten to [B * S, hidden]
        return self.fused()(x.reshape(-1, x.shape[-1])).view(x.shape)


class _SharedProjections:
    """SharedGemms over the block's two shared-expert projections."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        self._gate_up, self._down = gate_up, down

    def gate_up(self, x: Tensor) -> Tensor:  # x: [T, H] fp32 -> [T, 2S] fp32
        return self._gate_up(x).float()

    def down(self, h: Tensor) -> Tensor:  # h: [T, S] fp32 -> [T, H] fp32
        return self._down(h).float()


def block_state(w: ExpertWeights, prefix: str) -> dict[str, Tensor]:
    """`w` under SparseMoeBlock's parameter names at `prefix` (e.g. model.layers.3.mlp); None fields
    left out."""
    out = {f"{prefix}.router": w.router}
    for name in ("w13", "w2", *_OPTIONAL):
        t = getattr(w, name)
        if t is not None:
            out[f"{prefix}.{name}"] = t
    if w.shared is not None:
        if w.shared.w13 is not None and w.shared.w2 is not None:
            out[f"{prefix}.shared_w13"] = w.shared.w13
            out[f"{prefix}.shared_w2"] = w.shared.w2
        out[f"{prefix}.shared_gate"] = w.shared.gate
    return out


def stack_checkpoint_experts(
    state: Mapping[str, Tensor], moe_layers: Iterable[int], cfg: MoEConfig, block: str = "mlp"
) -> dict[str, Tensor]:
    """A checkpoint's state dict with each MoE layer's tensors (`model.layers.N.{block}.*`, the layouts
    `load_expert_weights` reads: Mixtral's `block_sparse_moe`, Qwen's and gpt-oss's `mlp`) replaced by
    SparseMoeBlock's at `model.layers.N.mlp`. Raises KeyError naming a missing tensor, ValueError on a
    shape mismatch; tensors of the block that the layout does not read are left for the loader's
    unexpected-tensor check. A layer already under SparseMoeBlock's names is left as it is (the loader
    runs every architecture's rename on a GGUF file's tensors too, for Phi-3's fused ones)."""
    out = dict(state)
    for n in moe_layers:
        if f"model.layers.{n}.mlp.router" in out:
            continue  # already under SparseMoeBlock's names: a GGUF file's (quant/gguf_checkpoint.py)
        prefix = f"model.layers.{n}.{block}"
        w = load_expert_weights(out, prefix, cfg)
        for key in [k for k in out if k.startswith(prefix + ".") and _read_by_layout(k, prefix, cfg)]:
            del out[key]
        out.update(block_state(w, f"model.layers.{n}.mlp"))
    return out


def _read_by_layout(key: str, prefix: str, cfg: MoEConfig) -> bool:
    """Whether `load_expert_weights` reads `key` (so it is replaced, not reported as unexpected)."""
    rest = key[len(prefix) + 1 :]
    if cfg.model_type == "gpt_oss":
        return rest in (
            "router.weight",
            "router.bias",
            "experts.gate_up_proj",
            "experts.gate_up_proj_bias",
            "experts.down_proj",
            "experts.down_proj_bias",
        )
    names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    read = {"gate.weight"} | {f"experts.{e}.{n}.weight" for e in range(cfg.num_experts) for n in names}
    if cfg.shared_expert_intermediate_size:
        read |= {f"shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        read.add("shared_expert_gate.weight")
    return rest in read
