"""Drop-in modules over a BlockQuantWeight (GGUF Q4_0/Q4_1/Q8_0, int8, int4) for CPU serving.

`BlockQuantLinear` replaces an nn.Linear (forward(x: [..., in_features]) -> [..., out_features]), and
`BlockQuantEmbedding` an nn.Embedding whose rows are quantized: a lookup dequantizes only the rows it
needs. A tied embedding and LM head share one BlockQuantWeight (one copy in memory).

Paths (the compiled kernel, server/quant/csrc/qlinear.cpp):
- M rows of x below GEMM_MIN_ROWS: the kernel: GEMV for M <= 4 (cpu_qlinear.GEMV_MAX_ROWS), above that
  its register-blocked GEMM on 12-row panels of W dequantized once per call (per chunk of x rows);
- prefill-sized M: W dequantized in slices of rows into a scratch buffer, each multiplied by torch's
  fp32 GEMM (MKL/oneDNN). From M = 256 up the two measured within noise of each other on this shared
  machine (benchmarks/cpu_qlinear.py `crossover`); 512 keeps the large prefill chunks on the library GEMM;
- `gemm_dtype = torch.bfloat16` (set by the engine where the CPU has AVX512-BF16 or AMX-BF16,
  server/quant/gemm_dtype.py): from M = BF16_GEMM_MIN_ROWS up the same dequantize + GEMM in bf16 (x and
  each slice rounded to bf16, bf16 products accumulated in fp32 by oneDNN, the bf16 result widened to
  fp32). Only the GEMM's inputs and output are bf16: the module still takes and returns fp32, so the
  residual stream, norms, rotary, softmax and attention stay fp32 around it. Below that M the kernel
  serves, told the layer's dtype (small_m_linear's `compute`): from 4 rows its bf16 batched path where
  AVX512-BF16 is usable (bf16 operands, fp32 sums and output), the fp32 GEMV below;
- int8 activations (server/quant/cpu_qgemv_q8.py, `int8_kernel`): with gemm_dtype bf16 or int8 on an
  AVX512-VNNI CPU, every batch of 5 rows or more of 4- or 8-bit weights in 32-blocks (prefill included; the Q8_0 LM
  head too) takes the batched int8 path ahead of the two bf16 paths above (KUBEINFER_INT8_GEMM, on by
  default), except where AMX-BF16 is usable: there batches of BF16_GEMM_MIN_ROWS rows and more go to the
  dequantize + bf16 GEMM (oneDNN on AMX tiles, faster from ~256 rows: cpu_qgemv_q8.AMX_GEMM_MAX_ROWS);
  1..4 rows the int8 GEMV where KUBEINFER_INT8_GEMV is on;
- a GGUF's 16-row tiles (INT8_TILED_FORMATS, csrc/qk_native.cpp): their own int8-activation kernel at every
  row count under gemm_dtype bf16 or int8 (`gemm_min_rows`), fp32 activations (exact, a row dequantized at
  a time) under fp32;
- no compiler: the plain-torch reference (dequantize, then matmul), slower but the same function.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.quant.cpu_qgemv_q8 import MAX_ROWS as Q8_MAX_ROWS
from server.quant.cpu_qgemv_q8 import (
    Q8GemvKernel,
    active_kernel,
    batches_take_any_rows,
    int8_gemm_enabled,
    small_m_linear,
)
from server.quant.cpu_qk_native import TILED as KQ_TILED
from server.quant.cpu_qk_native import try_load_qk_native_kernel
from server.quant.cpu_qlinear import (
    INT8_ACTIVATION_DTYPES,
    Q8_TILED,
    BlockQuantWeight,
    QLinearKernel,
    dequantize_reference,
    file_format,
    try_load_qlinear_kernel,
)
from server.quant.layers import QuantLinear

GEMM_MIN_ROWS = 512  # see the module docstring (benchmarks/cpu_qlinear.py `crossover`)
# bf16 GEMM's crossover against the fp32 kernel (benchmarks/cpu_qlinear.py `crossover`, docs/benchmarks.md)
BF16_GEMM_MIN_ROWS = 256
# 16-row tiles whose own int8 kernel serves every row count under bf16 where the int8 batched path does
# (gemm_min_rows): the 32-value formats' (Q8_0 / Q5_0 / IQ4_NL / Q5_1) and the k-quants'
INT8_TILED_FORMATS = frozenset(Q8_TILED.values()) | frozenset(KQ_TILED.values())
SLICE_BYTES = 32 << 20  # fp32 scratch per dequantized slice: a whole projection is one slice, one GEMM


def tiles_take_any_rows(kernel: QLinearKernel) -> bool:
    """Whether bf16 and int8 layers' 16-row tiles stay in their int8 kernel at every row count: where the
    row-major layout's batched int8 path takes any rows (batches_take_any_rows), and where the tiles'
    kernel runs its avx2 path with KUBEINFER_INT8_GEMM on: there it ran Llama-3.2-1B's Q4_K / Q6_K
    matrices at 512 rows 1.5-3.4x dequantize + fp32 GEMM (benchmarks/qk_avx2.py, an AVX2-only CPU simulated
    on Zen 5). Reads the switch and cached kernels only: asked per projection call."""
    if batches_take_any_rows(kernel):
        return True
    if not int8_gemm_enabled():
        return False
    qk = try_load_qk_native_kernel()
    return qk is not None and qk.isa == "avx2"


def _register(module: nn.Module, w: BlockQuantWeight) -> None:
    module.register_buffer("q", w.q)
    module.register_buffer("scales", w.scales)
    module.register_buffer("mins", w.mins)


def _weight(module: BlockQuantLinear | BlockQuantEmbedding, meta: BlockQuantWeight) -> BlockQuantWeight:
    # The buffers may have been replaced (module.to, load_state_dict): rebuild from what is registered.
    q, scales, mins = module.q, module.scales, module.mins
    if q is meta.q and scales is meta.scales and mins is meta.mins:
        return meta
    return BlockQuantWeight(
        q,
        scales,
        mins,
        meta.fmt,
        meta.bits,
        meta.group_size,
        meta.zero_point,
        meta.in_features,
        meta.out_features,
    )


class LoadKernel:
    """BlockQuantLinear's default `kernel`: find (or build) the compiled kernel in `cache_dir`; passing None
    instead runs the torch reference (a switched-off kernel, TP's rank loading)."""


LOAD_KERNEL = LoadKernel()


class BlockQuantLinear(QuantLinear):
    """y = x @ W^T + bias with W block-quantized; fp32 activations and accumulation (with `gemm_dtype`
    torch.bfloat16, GEMMs of 4 rows and more take bf16 operands: module docstring)."""

    q: Tensor
    scales: Tensor
    mins: Tensor | None
    bias: Tensor | None

    def __init__(
        self,
        w: BlockQuantWeight,
        bias: Tensor | None = None,  # [N]
        cache_dir: Path | None = None,
        kernel: QLinearKernel | LoadKernel | None = LOAD_KERNEL,  # a loaded kernel; None: the torch reference
    ) -> None:
        super().__init__(w.in_features, w.out_features)
        self.method = file_format(w.fmt)  # the format, not its layout (q4_k_x16 is q4_k)
        self._w = w
        _register(self, w)
        if bias is not None and tuple(bias.shape) != (w.out_features,):
            raise ValueError(f"bias must be [{w.out_features}], got {tuple(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.kernel: QLinearKernel | None = (
            try_load_qlinear_kernel(cache_dir) if isinstance(kernel, LoadKernel) else kernel
        )
        self.gemm_dtype = torch.float32

    # Counts gemm_dtype assignments on every instance: DecodeGraph re-reads its projections' dtypes only
    # when it moved (reading all 120 of the embedded model's twice a step cost ~60 us, 0.3 us now).
    gemm_dtype_changes: ClassVar[int] = 0

    @property
    def gemm_dtype(self) -> torch.dtype:
        """torch.float32, torch.bfloat16 or torch.int8 (server/quant/gemm_dtype.py): the dtype of the
        dequantize + GEMM path (module docstring; int8's is fp32) and what the kernels may take."""
        return self._gemm_dtype

    @gemm_dtype.setter
    def gemm_dtype(self, dtype: torch.dtype) -> None:
        self._gemm_dtype = dtype
        BlockQuantLinear.gemm_dtype_changes += 1

    @property
    def gemm_min_rows(self) -> int:
        """The fewest rows of x that leave the compiled kernel for dequantize + torch GEMM. 16-row tiles
        (Q8_0 / Q5_0 / IQ4_NL / Q5_1, the k-quants') under bf16 stay in their int8 kernel for every M as the
        row-major layout's int8 batched path does: a 2,048-token prefill step (16 x 128) 1.45x faster on
        Phi-4-mini Q4_K_M (17.5 -> 12.0 s), 1.18x on Llama-3.2-1B Q4_K_M and 1.2x on Gemma-3-1B than
        dequantize + bf16 GEMM (2-core Zen 5, AVX512-BF16 without AMX). Up to the same limit: where that
        path stops (AMX-BF16: oneDNN's AMX GEMM wins from 256 rows) or is switched off
        (KUBEINFER_INT8_GEMM=0), the bf16 GEMM takes over as for other weights. Under int8 the tiles
        likewise stay in their kernel, and everything else leaves at GEMM_MIN_ROWS as under fp32. On an
        AVX2-only CPU (no batched int8 path) the tiles stay too (`tiles_take_any_rows`)."""
        if self.gemm_dtype == torch.float32:
            return GEMM_MIN_ROWS
        if self._w.fmt in INT8_TILED_FORMATS and self.kernel is not None and tiles_take_any_rows(self.kernel):
            return sys.maxsize
        return BF16_GEMM_MIN_ROWS if self.gemm_dtype == torch.bfloat16 else GEMM_MIN_ROWS

    @staticmethod
    def fuse(parts: list[BlockQuantLinear]) -> BlockQuantLinear | None:
        """One module computing the parts' outputs side by side (fused q/k/v, gate/up), or None if they
        differ in format, K or gemm_dtype, or only some have a bias."""
        first = parts[0]._w
        if any(
            (p._w.fmt, p._w.in_features, p._w.group_size) != (first.fmt, first.in_features, first.group_size)
            or p.gemm_dtype != parts[0].gemm_dtype
            for p in parts
        ):
            return None
        biases = [p.bias for p in parts]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return None
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        w = BlockQuantWeight.concat_rows([p.weight_q for p in parts])
        fused = BlockQuantLinear(w, bias, kernel=parts[0].kernel)
        fused.gemm_dtype = parts[0].gemm_dtype
        return fused

    @property
    def weight_q(self) -> BlockQuantWeight:
        return _weight(self, self._w)

    def int8_kernel(self, rows: int) -> Q8GemvKernel | None:
        """The int8-activation kernel where it takes `rows` rows of x for this layer: its batched path
        (more than 4 rows, at most AMX_GEMM_MAX_ROWS where AMX-BF16 is usable, 4/8-bit weights in
        32-blocks, AVX512-VNNI, gemm_dtype bf16 or int8, KUBEINFER_INT8_GEMM on), or its GEMV (1-4 rows,
        KUBEINFER_INT8_GEMV on); else None."""
        if self.kernel is None or (rows > Q8_MAX_ROWS and self.gemm_dtype not in INT8_ACTIVATION_DTYPES):
            return None
        q8 = active_kernel(self.kernel)
        return q8 if q8 is not None and q8.supports(self.weight_q, rows, self.gemm_dtype) else None

    def pack_int8(self, q8: Q8GemvKernel) -> int:
        """Gives the weight its packed copy for `q8`'s batched path (Q8GemvKernel.pack) unless it has one
        or the path cannot take it; returns the bytes added. The copy follows the registered buffers: a
        module whose q/scales/mins are replaced afterwards (`to`, load_state_dict(assign=True)) runs
        unpacked again; values changed in place leave the copy stale (the server changes none after load)."""
        w = self.weight_q
        packed = q8.pack(w)
        if packed is w:
            return 0
        self._w = packed
        assert packed.packed is not None
        return packed.packed.numel()

    def bf16_gemm(self, rows: int) -> bool:
        """Whether `rows` rows of x go through the bf16 library GEMM with nothing added after it (no
        bias): its result is then bf16 itself, and forward(x, out_dtype=torch.bfloat16) returns it unwidened,
        as a bf16 x goes in without a round trip through fp32. The MLP chains gate_up -> silu_mul -> down
        in bf16 where this holds (server/models/llama.py)."""
        return (
            self.kernel is not None
            and self.gemm_dtype == torch.bfloat16
            and self.bias is None
            and rows >= self.gemm_min_rows
            and self.int8_kernel(rows) is None
        )

    def forward(
        self, x: Tensor, out_dtype: torch.dtype | None = None
    ) -> Tensor:  # x: [..., K] -> [..., N] in out_dtype (default x's dtype)
        lead, dtype = x.shape[:-1], x.dtype if out_dtype is None else out_dtype
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        w = self.weight_q
        if self.kernel is not None and self.bf16_gemm(x2.shape[0]):
            # bf16 x is the GEMM's operand as is; a bf16 result comes back without widening
            y = self._dequant_gemm(x2, w, self.kernel, torch.bfloat16, out_dtype=dtype)
            return y.reshape(*lead, self.out_features)
        x2 = x2.float()
        q8 = self.int8_kernel(x2.shape[0]) if self.kernel is not None else None
        if self.kernel is None:
            y = F.linear(x2, dequantize_reference(w), self.bias)
        elif q8 is not None:  # int8 activations (cpu_qgemv_q8.py): batches on VNNI, the GEMV where on
            y = q8.linear(x2, w, self.bias, compute=self.gemm_dtype)
        elif x2.shape[0] >= self.gemm_min_rows:  # int8 layers' GEMMs without an int8 path run in fp32
            dense = torch.bfloat16 if self.gemm_dtype == torch.bfloat16 else torch.float32
            y = self._dequant_gemm(x2, w, self.kernel, dense)
        else:  # decode-sized M: int8 activations where that switch is on (cpu_qgemv_q8.py)
            y = small_m_linear(self.kernel, x2, w, self.bias, self.gemm_dtype)
        return y.reshape(*lead, self.out_features).to(dtype)

    def _dequant_gemm(
        self,
        x: Tensor,
        w: BlockQuantWeight,
        kernel: QLinearKernel,
        compute: torch.dtype = torch.float32,
        out_dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        # x: [M, K] fp32 (or bf16 with compute=bf16) -> [M, N] out_dtype. compute=bfloat16: x and each
        # dequantized slice rounded to bf16, multiplied by torch's bf16 GEMM (bf16 result, widened to fp32
        # unless out_dtype is bf16): AVX512-BF16/AMX do 3x the fp32 FLOP/s (docs/benchmarks.md).
        m, k, n = x.shape[0], self.in_features, self.out_features
        x = x.contiguous()
        xc = x if compute == x.dtype else x.to(compute)
        if out_dtype != torch.float32:
            assert compute == out_dtype and self.bias is None, "a low-precision output is the GEMM's own"
        out = torch.empty(m, n, dtype=out_dtype)
        rows = max(16, SLICE_BYTES // (4 * k))
        # W straight to bf16 where the kernel can (the same values as rounding the fp32 slice, unwritten)
        straight = compute == torch.bfloat16 and kernel.bf16_dequant_supported(w)
        scratch = torch.empty(min(rows, n), k, dtype=compute if straight else torch.float32)
        for n0 in range(0, n, rows):
            r = min(rows, n - n0)
            if straight:
                taken = kernel.dequantize_rows_bf16(w, n0, r, scratch[:r])
                assert taken, "bf16_dequant_supported said the kernel takes W"
                tile = scratch[:r]
            else:
                tile = kernel.dequantize_rows(w, start=n0, count=r, out=scratch[:r])
            if compute != torch.float32 and out_dtype == compute and r == n:
                torch.mm(xc, tile.to(compute).t(), out=out)
            elif compute != torch.float32:
                out[:, n0 : n0 + r] = xc @ tile.to(compute).t()
            elif r == n:
                torch.mm(x, tile.t(), out=out)
            else:
                out[:, n0 : n0 + r] = x @ tile.t()
        if self.bias is not None:
            out += self.bias
        return out

    def weight_nbytes(self) -> int:
        return self.weight_q.nbytes() + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self._w.group_size}"


class BlockQuantEmbedding(nn.Module):
    """nn.Embedding over a block-quantized [num_embeddings, embedding_dim] table: ids [T] -> [T, dim] fp32."""

    q: Tensor
    scales: Tensor
    mins: Tensor | None

    def __init__(self, w: BlockQuantWeight, cache_dir: Path | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = w.out_features, w.in_features
        self._w = w
        _register(self, w)
        self.kernel: QLinearKernel | None = try_load_qlinear_kernel(cache_dir)

    @property
    def weight_q(self) -> BlockQuantWeight:
        return _weight(self, self._w)

    def forward(self, ids: Tensor) -> Tensor:  # ids: [...] int -> [..., dim] fp32
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        w = self.weight_q
        if self.kernel is None:
            rows = dequantize_reference(w, flat)
        else:
            rows = self.kernel.dequantize_rows(w, flat)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self._w.fmt}"
