"""Block-quantized experts on CPU: each expert's w13 [2I, H] and w2 [H, I] kept as a BlockQuantWeight
(GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K, int8; server/quant/cpu_qlinear.py) and run through qlinear's CPU kernel
per expert, so a step reads only its chosen experts' quantized bytes. Without the kernel (no compiler),
the torch reference (`linear_reference`) serves.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch
from torch import Tensor, nn

from server.models.moe.block import SparseMoeBlock
from server.models.moe.config import MoEConfig
from server.models.moe.native import (
    ACTIVATIONS,
    KIND_QLINEAR,
    FusedExpertsCall,
    KiMoeExperts,
    descriptor_array,
    fused_enabled,
    try_load_moe_experts_kernel,
)
from server.models.moe.weights import ExpertWeights
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qgemv_q8 import (
    Q8GemvKernel,
    active_kernel,
    decode_entry,
    int8_gemm_enabled,
    int8_pack_switch,
    small_m_linear,
)
from server.quant.cpu_qlinear import (
    GGUF_SUPER_BLOCK_BYTES,
    INT8_ACTIVATION_DTYPES,
    BlockQuantWeight,
    QLinearKernel,
    from_gguf_blocks,
    from_gguf_k_blocks,
    from_int8,
    linear_reference,
    quantize_block,
    weight_descriptor,
)
from server.quant.cpu_repack import quantize_int8
from server.quant.gemm_dtype import GEMM_DTYPES, packed_copies_fit

log = logging.getLogger(__name__)
PACK_GROUP_ROWS = 16  # rows per group of qgemv_q8's packed copy (csrc/moe_experts.cpp's PACK_ROWS)


def split_gguf_experts(
    raw: np.ndarray | Tensor, fmt: str, num_experts: int, n: int, k: int
) -> list[BlockQuantWeight]:
    """A GGUF stacked expert tensor -> one BlockQuantWeight [N, K] per expert.

    llama.cpp stores a block's experts as one tensor (`blk.L.ffn_{gate,up,down}_exps.weight`, ggml shape
    `{K, N, E}`, i.e. E consecutive [N, K] matrices of ggml blocks), so expert e is the e-th E-th of the
    bytes. Formats: q4_0, q4_1, q8_0, q4_k, q6_k. Raises ValueError when the bytes do not split evenly
    or an expert's bytes do not match its format and shape."""
    data = torch.as_tensor(np.ascontiguousarray(raw)).view(torch.uint8).reshape(-1)
    if num_experts < 1 or data.numel() % num_experts:
        raise ValueError(f"{data.numel()} bytes do not split into {num_experts} experts")
    per = data.numel() // num_experts
    conv = from_gguf_k_blocks if fmt in GGUF_SUPER_BLOCK_BYTES else from_gguf_blocks
    return [conv(data[e * per : (e + 1) * per], fmt, n, k) for e in range(num_experts)]


def _quantize_one(t: Tensor, fmt: str) -> BlockQuantWeight:  # t: [N, K] one weight
    """Round-to-nearest into `fmt`: `int8` per output channel (cpu_repack.quantize_int8, --quantize
    int8's), else q8_0 / q4_0 / q4_1 blocks (cpu_qlinear.quantize_block)."""
    return from_int8(*quantize_int8(t)) if fmt == "int8" else quantize_block(t, fmt)


class BlockQuantExperts:
    """ExpertGemms over per-expert BlockQuantWeights. Raises ValueError when the lists disagree in
    length or the weights' shapes do not chain (w13 [2I, H] then w2 [H, I])."""

    def __init__(
        self,
        w13: list[BlockQuantWeight],  # E x [2I, H], gate rows then up rows
        w2: list[BlockQuantWeight],  # E x [H, I]
        b13: Tensor | None = None,  # [E, 2I] fp32
        b2: Tensor | None = None,  # [E, H] fp32
        kernel: QLinearKernel | None = None,
        compute: torch.dtype = torch.float32,  # the gemm_dtype: bf16 takes qlinear's bf16 batched path, bf16/int8 int8 paths
    ) -> None:
        if len(w13) != len(w2) or not w13:
            raise ValueError(f"w13 and w2 need one weight per expert, got {len(w13)} and {len(w2)}")
        for e, (a, b) in enumerate(zip(w13, w2, strict=True)):
            if a.out_features != 2 * b.in_features or b.out_features != a.in_features:
                raise ValueError(
                    f"expert {e}: w13 [{a.out_features}, {a.in_features}] and w2 "
                    f"[{b.out_features}, {b.in_features}] do not chain as [2I, H] and [H, I]"
                )
        self.w13, self.w2 = w13, w2
        self.b13 = None if b13 is None else b13.float().contiguous()
        self.b2 = None if b2 is None else b2.float().contiguous()
        self.kernel = kernel
        self.compute = compute
        self._call: tuple[tuple[object, ...], FusedExpertsCall] | None = None

    def set_gemm_dtype(self, dtype: torch.dtype) -> int:
        """The engine's GEMM dtype (server/quant/gemm_dtype.py, through SparseMoeBlock.set_gemm_dtype):
        under bf16 an expert's 4+ tokens take qlinear's bf16 batched path (or the int8 batched path
        where its switch and the weight allow), fewer stay fp32 GEMVs; under int8 the tiles and the int8
        paths take every token count, the rest stays fp32. Returns 1; ValueError for a dtype other than
        fp32, bf16 or int8."""
        if dtype not in GEMM_DTYPES:
            raise ValueError(f"block-quantized experts compute in float32, bfloat16 or int8, not {dtype}")
        self.compute = dtype
        return 1

    @staticmethod
    def quantize(
        w: ExpertWeights, fmt: str, kernel: QLinearKernel | None = None, compute: torch.dtype = torch.float32
    ) -> BlockQuantExperts:
        """Round-to-nearest per expert into q8_0 / q4_0 / q4_1 (cpu_qlinear.quantize_block) or `int8`
        (per output channel, `--quantize int8`'s: cpu_repack.quantize_int8, each expert's own scales)."""
        if w.w13 is None or w.w2 is None:
            raise ValueError("quantize needs the dense w13 and w2")

        return BlockQuantExperts(
            [_quantize_one(w.w13[e], fmt) for e in range(w.w13.shape[0])],
            [_quantize_one(w.w2[e], fmt) for e in range(w.w2.shape[0])],
            w.b13,
            w.b2,
            kernel,
            compute,
        )

    @staticmethod
    def from_gguf(
        gate: tuple[np.ndarray | Tensor, str],  # (ffn_gate_exps data, its format)
        up: tuple[np.ndarray | Tensor, str],  # (ffn_up_exps data, its format: gate's)
        down: tuple[np.ndarray | Tensor, str],  # (ffn_down_exps data, its format: may differ, Q4_K_M's q6_k)
        cfg: MoEConfig,
        kernel: QLinearKernel | None = None,
        compute: torch.dtype = torch.float32,
    ) -> BlockQuantExperts:
        """From llama.cpp's stacked expert tensors (split_gguf_experts); gate and up rows concatenated per
        expert, so they must share a format. Raises ValueError otherwise or on a size mismatch."""
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        gates = split_gguf_experts(gate[0], gate[1], e, i, h)
        ups = split_gguf_experts(up[0], up[1], e, i, h)
        w13 = [BlockQuantWeight.concat_rows([g, u]) for g, u in zip(gates, ups, strict=True)]
        return BlockQuantExperts(
            w13, split_gguf_experts(down[0], down[1], e, h, i), kernel=kernel, compute=compute
        )

    def nbytes(self) -> int:
        return sum(q.nbytes() for q in self.w13 + self.w2)

    def packed_bytes(self, q8: Q8GemvKernel) -> int:
        """Bytes pack_int8(q8) would add (0: already packed, or not packable on this path)."""
        return sum(q8.packed_bytes(w) for w in self.w13 + self.w2 if w.packed is None)

    def pack_int8(self, q8: Q8GemvKernel) -> int:
        """Gives every expert weight the batched int8 path can take its packed copy (Q8GemvKernel.pack),
        made once here instead of on every call: an expert's 5+ tokens in a step (16 users over 16 experts,
        prefill chunks) then read it in place. The fused call slices it per 16-row group
        (csrc/moe_experts.cpp). Returns the bytes added; the GEMV (1-4 tokens) still reads the weights as
        stored, so both stay held."""
        before = sum(0 if w.packed is None else w.packed.numel() for w in self.w13 + self.w2)
        self.w13 = [q8.pack(w) for w in self.w13]
        self.w2 = [q8.pack(w) for w in self.w2]
        self._call = None  # its descriptors point at the unpacked weights
        return sum(0 if w.packed is None else w.packed.numel() for w in self.w13 + self.w2) - before

    def tensors(self) -> list[Tensor]:
        """Every tensor the experts hold (SparseMoeBlock.held_weight_tensors)."""
        return [t for q in self.w13 + self.w2 for t in q.tensors()]

    def _linear(self, x: Tensor, w: BlockQuantWeight, bias: Tensor | None) -> Tensor:
        x = x.float().contiguous()
        if self.kernel is None:
            return linear_reference(x, w, bias)
        # the same choice of kernel as the fused call's entry point (decode_entry) makes in C++
        b = None if bias is None else bias.contiguous()
        return small_m_linear(self.kernel, x, w, b, compute=self.compute)

    def fused_call(self, cfg: MoEConfig) -> FusedExpertsCall | None:
        """The block's experts for the native call (server/models/moe/native.py), descriptors built once
        per compute dtype; None without qlinear's kernel or the call's library, or under
        KUBEINFER_MOE_FUSED=0 (FusedMoE then runs one kernel call per expert from Python)."""
        if self.kernel is None or not fused_enabled():
            return None
        key = (self.compute, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        if self._call is not None and self._call[0] == key:
            return self._call[1]
        lib = try_load_moe_experts_kernel()
        if lib is None:
            return None
        w13 = descriptor_array([weight_descriptor(w, self.compute) for w in self.w13])
        w2 = descriptor_array([weight_descriptor(w, self.compute) for w in self.w2])
        spec = KiMoeExperts(
            kind=KIND_QLINEAR,
            activation=ACTIVATIONS[cfg.activation],
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
            num_experts=len(self.w13),
            hidden=self.w13[0].in_features,
            inter=self.w2[0].in_features,
            w13=ctypes.addressof(w13),
            w2=ctypes.addressof(w2),
            desc_bytes=ctypes.sizeof(w13[0]),
            b13=None if self.b13 is None else self.b13.data_ptr(),
            b2=None if self.b2 is None else self.b2.data_ptr(),
            w13_packed_group_bytes=_packed_group_bytes(self.w13),
            w2_packed_group_bytes=_packed_group_bytes(self.w2),
        )
        # the descriptors point into the weights' tensors, which this object keeps alive
        call = FusedExpertsCall(lib, spec, (w13, w2, self.b13, self.b2, self.w13, self.w2))
        self._call = (key, call)
        return call

    def fused_entry(self) -> int:
        """The projection entry point the fused call runs now (decode_entry: the int8 GEMV's modes set
        from their switches, as for every other projection)."""
        assert self.kernel is not None
        return decode_entry(self.kernel).address

    def gate_up(self, e: int, x: Tensor) -> Tensor:  # x: [n, H] -> [n, 2I] fp32
        return self._linear(x, self.w13[e], None if self.b13 is None else self.b13[e])

    def down(self, e: int, h: Tensor) -> Tensor:  # h: [n, I] -> [n, H] fp32
        return self._linear(h, self.w2[e], None if self.b2 is None else self.b2[e])


def _packed_group_bytes(ws: list[BlockQuantWeight]) -> int:
    """The packed copies' bytes per 16-row group, one value for all of `ws`; 0 (the fused call then reads
    the weights as stored) unless every weight has a copy and all share that stride."""
    strides = set()
    for w in ws:
        groups = -(-w.out_features // PACK_GROUP_ROWS)
        if w.packed is None or w.packed.numel() % groups:
            return 0
        strides.add(w.packed.numel() // groups)
    return strides.pop() if len(strides) == 1 else 0


def pack_moe_int8_weights(model: nn.Module, reserve_bytes: int = 0) -> int:
    """pack_int8_weights (server/quant/gemm_dtype.py) for block-quantized experts: every bf16 or int8 expert set
    gets its packed copies (BlockQuantExperts.pack_int8) when the batched int8 path is on here, under the
    same switch and memory rule: KUBEINFER_INT8_PACK=0 packs nothing, =1 all; unset, only if all copies
    fit in PACK_MEMORY_SHARE of the memory available now and leave `reserve_bytes` of it free (logged when
    they do not). Returns the bytes added; ValueError for a bad switch value."""
    switch = int8_pack_switch()
    if switch is False or not int8_gemm_enabled():
        return 0
    todo = []
    for block in model.modules():
        experts = block.experts if isinstance(block, SparseMoeBlock) else None
        if isinstance(experts, BlockQuantExperts) and experts.kernel is not None:
            q8 = active_kernel(experts.kernel) if experts.compute in INT8_ACTIVATION_DTYPES else None
            if q8 is not None and q8.isa == "vnni":
                todo.append((experts, q8))
    need = sum(experts.packed_bytes(q8) for experts, q8 in todo)
    if not packed_copies_fit(need, switch, "int8 expert batches", reserve_bytes):
        return 0
    return sum(experts.pack_int8(q8) for experts, q8 in todo)


def _shared_projection(t: Tensor, fmt: str, kernel: QLinearKernel | None) -> BlockQuantLinear:  # t: [N, K]
    # None: the dense projections' kernel switch is off, so qlinear's torch reference, as theirs
    return BlockQuantLinear(_quantize_one(t.float(), fmt), kernel=kernel)


def quantize_moe_blocks(model: nn.Module, fmt: str, kernel: QLinearKernel | None) -> int:
    """`--quantize` for mixture-of-experts layers: every SparseMoeBlock of `model` with dense experts
    serves them as BlockQuantExperts in `fmt` (each expert's w13 and w2 quantized on its own; biases
    kept in fp32), and Qwen2-MoE's shared expert as two BlockQuantLinear projections in `fmt`, as
    every dense projection is. The router and the shared expert's sigmoid gate stay in the model's
    dtype: the router's top-k is where a rounding error would change which experts run. Returns the
    blocks converted."""
    n = 0
    for block in model.modules():
        if isinstance(block, SparseMoeBlock) and block.experts is None:
            w = block.expert_weights()
            block.set_experts(BlockQuantExperts.quantize(w, fmt, kernel))
            if w.shared is not None and w.shared.w13 is not None and w.shared.w2 is not None:
                gate_up, down = (_shared_projection(t, fmt, kernel) for t in (w.shared.w13, w.shared.w2))
                block.set_shared_expert(gate_up, down)
            n += 1
    return n
