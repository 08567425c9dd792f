"""The dtype of a block-quantized model's large CPU GEMMs (prefill, large batches), from `--dtype`.

vLLM's `--dtype` semantics, applied to the weights we keep quantized (a GGUF file served as it is, a
`--quantize`d or pre-quantized checkpoint repacked into BlockQuantLinear): `auto` picks bf16 where the
CPU computes it natively (AVX512-BF16 or AMX-BF16 usable, server/models/loader.cpu_has_native_bf16:
what the OS enables, minus KUBEINFER_CPU_DISABLE), int8 where it does not but an int8-activation kernel
runs (AVX512-VNNI: Ice Lake's class; AVX2-only CPUs, for the decode GEMV), fp32 elsewhere; `bfloat16` asks
for bf16, `float32` (and `float16`, which the CPU kernels do not run) for fp32, exact activations.

int8 (`torch.int8` as the gemm_dtype: `cpu_gemm_dtype`) keeps the layers in fp32 and lets every block-quantized
GEMM whose kernel has an int8-activation path take it, as llama.cpp does on every CPU (ggml's Q8 blocks of
x, integer dot products): a GGUF's 16-row tiles (at every row count where the int8 batched path takes any:
BlockQuantLinear.gemm_min_rows; csrc/qk_native.cpp; the loader holds
them where the layers compute in bf16 or int8, gguf_checkpoint.super_blocks_enabled), the row-major 4/8-bit
weights' GEMV and batched path (server/quant/cpu_qgemv_q8.py; on an AVX2-only CPU only the GEMV of 1-4
rows, and no tiles); what has none (the fp32 kernel, dequantize + GEMM from GEMM_MIN_ROWS rows) computes in
fp32, never in bf16. Without it, a VNNI CPU without bf16 read the file repacked (1.3-3x its bits) with
fp32 activations: Llama-3.2-1B Q4_K_M one stream 15.9 tok/s against the tiles' 47.6, and an AVX2-only one
decoded it at 15.7 against the int8 GEMV's 32.0 (simulated; docs/benchmarks-log.md, "int8 activations
where the layers compute in fp32").

Where the CPU also has AVX512-VNNI, a bf16 layer's batches of 5+ rows of 4-bit weights take int8
activations instead (server/quant/cpu_qgemv_q8.py, KUBEINFER_INT8_GEMM): faster still, and of the same
order of error as bf16 operands. Otherwise,
what runs in bf16 is BlockQuantLinear's GEMMs (server/quant/block_linear.py): from BF16_GEMM_MIN_ROWS
rows up its dequantize + GEMM path (x and the dequantized weight rounded to bf16, oneDNN accumulates in
fp32, the product rounded to bf16 and widened back), and from 4 rows up to that the compiled kernel's
bf16 batched path (csrc/qlinear.cpp: bf16 operands, fp32 sums and output; the decode graph too), where
AVX512-BF16 is usable. Everything else stays fp32: the residual
stream (a sum of 60 layer outputs, where bf16's 8-bit mantissa would lose the small updates), RMSNorm
(a mean of squares), rotary, softmax and attention (computed in fp32; the KV cache itself is bf16 under
`auto` on such CPUs, server/attention/kv_cache_dtype.py, since the decode kernel is bound by its bytes
at 16+ users), and decode of 1..3 rows, whose GEMV is bound by the weight's bytes, not by FLOPs (the
fp32 kernel reads the same quantized bytes either way). A GGUF's tied LM head is a BlockQuantLinear and
follows gemm_dtype like the projections (bf16 operands from 4 rows); its logits, the output, stay fp32.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from server import cpu_env
from server.native import KernelBuildError, usable_cpu_features
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qgemv_q8 import (
    PACK_ENABLE_ENV,
    PACK_MEMORY_SHARE,
    active_kernel,
    int8_gemm_enabled,
    int8_pack_switch,
    path_for,
)
from server.quant.cpu_qlinear import INT8_ACTIVATION_DTYPES

log = logging.getLogger(__name__)

GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def cpu_gemm_dtype(compute: torch.dtype, requested: str = "float32") -> torch.dtype:
    """The GEMM dtype for a model whose `--dtype` (`requested`) resolved to `compute` (loader.resolve_dtype,
    which already maps `auto` to bf16 only on CPUs with native bf16): bf16 for bf16; int8 for `auto`
    resolved to fp32 where an int8-activation kernel beats fp32 (int8_activations_run); fp32 for the rest."""
    if compute == torch.bfloat16:
        return torch.bfloat16
    if requested == "auto" and compute == torch.float32 and int8_activations_run():
        return torch.int8
    return torch.float32


def int8_activations_run() -> bool:
    """Whether an int8-activation kernel beats fp32 activations here (`usable_cpu_features`, minus
    KUBEINFER_CPU_DISABLE, read now): AVX512-VNNI with VL and BW (the GGUF tiles' kernels, csrc/qk_native.cpp,
    and csrc/qgemv_q8.cpp's GEMV and batched path), or AVX2 with FMA and F16C (qgemv_q8.cpp's GEMV over the
    row-major 4/8-bit weights; the tiles and the batched path are VNNI-only, so batches stay fp32 there, and
    a GGUF stays repacked): one stream's decode of Llama-3.2-1B Q4_K_M 2.0x the fp32 GEMV with the kernels
    built for AVX2 only (simulated on a Zen 5, docs/benchmarks-log.md). False on neither, and where the
    feature probe cannot be built."""
    try:
        features = usable_cpu_features()
    except (KernelBuildError, OSError):
        return False
    return path_for(features) in ("vnni", "avx2")


@runtime_checkable
class FollowsGemmDtype(Protocol):
    """A module kind other than BlockQuantLinear whose quantized GEMMs follow the engine's GEMM dtype:
    `apply_gemm_dtype` calls its `set_gemm_dtype` (a mixture-of-experts block's quantized experts,
    server/models/moe/block.py), so that one walk serves every model, a draft model included."""

    def set_gemm_dtype(self, dtype: torch.dtype) -> int:
        """Sets `dtype` (fp32, bf16 or int8, already checked) on its weight sets; returns how many (0: none
        of its weights are quantized)."""
        ...


def apply_gemm_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Sets every BlockQuantLinear's `gemm_dtype` to `dtype` (fp32, bf16 or int8) and hands it to every
    module implementing `FollowsGemmDtype` (quantized experts); returns how many weight sets were set.
    Raises ValueError for any other dtype."""
    if dtype not in GEMM_DTYPES:
        raise ValueError(f"block-quantized GEMMs run in float32, bfloat16 or int8, not {dtype}")
    count = 0
    for module in model.modules():
        if isinstance(module, BlockQuantLinear):
            module.gemm_dtype = dtype
            count += 1
        elif isinstance(module, FollowsGemmDtype):
            count += module.set_gemm_dtype(dtype)
    return count


def pack_int8_weights(model: nn.Module, reserve_bytes: int = 0) -> int:
    """Gives every bf16 or int8 BlockQuantLinear the batched int8 path can take its packed copy
    (BlockQuantLinear.pack_int8) when that path is on here; returns the bytes added (0: nothing packed).
    KUBEINFER_INT8_PACK=0 packs nothing, =1 packs all; unset, it packs only if all copies together fit in
    PACK_MEMORY_SHARE of the memory available (cpu_env.available_memory_bytes: MemAvailable, or the
    memory cgroup's headroom where smaller) and leave `reserve_bytes` of it (what the caller allocates
    after them: the engine's KV cache) free; logged when they do not. Raises ValueError for a bad switch
    value."""
    switch = int8_pack_switch()
    if switch is False or not int8_gemm_enabled():
        return 0
    modules = [
        m
        for m in model.modules()
        if isinstance(m, BlockQuantLinear) and m.gemm_dtype in INT8_ACTIVATION_DTYPES
    ]
    kernels = [(m, active_kernel(m.kernel) if m.kernel is not None else None) for m in modules]
    todo = [(m, q8) for m, q8 in kernels if q8 is not None and q8.isa == "vnni" and m.weight_q.packed is None]
    need = sum(q8.packed_bytes(m.weight_q) for m, q8 in todo)
    if not packed_copies_fit(need, switch, "int8 batches", reserve_bytes):
        return 0
    return sum(m.pack_int8(q8) for m, q8 in todo)


def packed_copies_fit(need: int, switch: bool | None, what: str, reserve_bytes: int = 0) -> bool:
    """Whether `need` bytes of packed copies are made: some are needed, and the switch (int8_pack_switch:
    True packs all) says so or, unset, they fit in PACK_MEMORY_SHARE of the memory available now and leave
    `reserve_bytes` of it free (memory still to be allocated after them: a pod whose limit was sized for
    weights + KV cache + runtime must not spend its KV cache's room on copies); logged, naming `what`,
    when they do not."""
    if need == 0:
        return False
    avail = cpu_env.available_memory_bytes()
    if switch is None and (avail is None or need > PACK_MEMORY_SHARE * avail or need + reserve_bytes > avail):
        log.info(
            "%s read the weights unpacked: packed copies would take %.0f MiB, over %.0f%% of the "
            "%s MiB available or more than it leaves beside the %.0f MiB still to allocate (%s=1 packs anyway)",
            what,
            need / 2**20,
            100 * PACK_MEMORY_SHARE,
            "?" if avail is None else f"{avail / 2**20:.0f}",
            reserve_bytes / 2**20,
            PACK_ENABLE_ENV,
        )
        return False
    return True
