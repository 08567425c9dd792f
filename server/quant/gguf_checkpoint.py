"""A GGUF file's tensors under Hugging Face names, quantized ones kept quantized (BlockQuantWeight).

The GGUF layout is llama.cpp's (gguf-py's GGUFReader reads it): tensor names such as blk.3.attn_q.weight,
mapped per `general.architecture` (gguf_names.py: llama, qwen2, qwen3, granite, smollm3, olmo2, phi3,
gemma, gemma2, gemma3), shapes in ggml order (ne0 = in_features first), q/k projection rows permuted by
convert_hf_to_gguf.py for ggml's rotary layout in the Llama-converted families, and Gemma's norm weights
stored + 1. The permutation is undone here on whole rows, so quantized rows move without being touched
(exactly what transformers' GGUF loader does on the dequantized matrix); the + 1 is taken back. Q4_0, Q4_1, Q8_0, Q4_K and Q6_K tensors stay quantized (where their kernel runs
AVX512-VNNI or AVX2, `super_blocks_enabled`: both as 16-row tiles of the file's own super-blocks
(q4_k_x16, q6_k_x16; N a multiple of 16), experts included; else, and for Q4_K of other N, repacked into
per-sub-block fp32 scales, exactly: cpu_qlinear.from_gguf_k_blocks), and so do Q5_0, Q5_1, Q5_K, Q3_K,
Q2_K, IQ4_NL and IQ4_XS (repacked exactly into 8-bit groups: gguf_repack.py; where the Q4_K tiles are held,
Q5_K, IQ4_XS, Q3_K and Q2_K of whole tiles are held as their own 16-row tiles instead, within 1/8 bit per
weight of the file's bits: `TILE_ONLY_TYPES`); MXFP4 expert stacks
(gpt-oss) stay MXFP4 (`GgufCheckpoint.mxfp4_experts`, cpu_mxfp4.from_gguf_mxfp4). Any other type (IQ2_*,
IQ3_*, IQ1_*, TQ*, ...) and F16/BF16 are read as fp32; each such tensor is logged and listed in
`GgufCheckpoint.dequantized` with the memory it costs beyond its bytes in the file (/info shows it).
Where the k-quant tiles are held (`super_blocks_enabled`, the avx2 path included), so are the 32-value
formats' of whole 16-row tiles, experts included: Q5_0, IQ4_NL and Q5_1 (`TILE_32_FORMATS`) as q5_0_x16 /
iq4_nl_x16 / q5_1_x16 (cpu_qlinear.interleave_q8_x16) at the file's 5.5 / 4.5 / 6.0 bits per weight, and
on AVX512-VNNI (`q8_tiles_enabled`) Q8_0 as q8_0_x16 at its 8.5: one copy for decode and batches, instead
of the row-major repacks (8.5 / 8.5 / 9.0 bits) plus the batched path's 10-bit int8 packed copy.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from server.cpu_env import release_free_heap
from server.native import env_switch
from server.quant import cpu_qk_native
from server.quant.cpu_mxfp4 import from_gguf_mxfp4
from server.quant.cpu_qk_native import X16_ROWS
from server.quant.cpu_qlinear import (
    INT8_ACTIVATION_DTYPES,
    BlockQuantWeight,
    from_gguf_blocks,
    from_gguf_k_blocks,
    from_gguf_k_super_blocks,
    interleave_q8_x16,
    interleave_x16,
    q8_tileable,
)
from server.quant.gguf_names import GLOBAL_NAMES, LAYOUTS, GgufLayout
from server.quant.gguf_repack import REPACKED, from_gguf_repacked

log = logging.getLogger(__name__)

_KEPT = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
_KEPT_K = {"Q4_K": "q4_k", "Q6_K": "q6_k"}
_FLOAT = ("F32", "F16", "BF16")
# k-quant types held as the file's own super-blocks (csrc/qk_native.cpp) instead of repacked, where the
# kernel runs AVX512-VNNI (or AVX2: tiles only, below), and where N is a multiple of 16 re-laid in 16-row tiles (q4_k_x16 at 4.625 bits,
# q6_k_x16 at 6.56, against the repack's 6.0 plus Q4_K's 8.5-bit int8 packed copy and 10.0): each VNNI dot
# product serves 16 output rows, one row of x 1.6-1.9x the repack's speed, 16 rows about the packed copy's
# (docs/benchmarks-log.md "k-quants in 16-row tiles"). Other Q4_K stays repacked (its row-major blocks run
# batches at 0.5-0.7x); other Q6_K stays row-major blocks (1.35-1.45x the repack at 16 rows). Under the same
# switch the 32-value formats of whole tiles are held as 16-row tiles (tiled_32_formats): the file's bits per
# weight (Q8_0 8.5, Q5_0 5.5, IQ4_NL 4.5, Q5_1 6.0) against 8.5 or 9.0 plus the int8 packed copy's 10.0;
# Q8_0 / Q5_0 one row of x 1.0-1.9x, 4 rows 3-5x, 16-64 rows 0.8-1.0x the row-major GEMV and packed batched path (docs/benchmarks-log.md "Q8_0 and Q5_0 in 16-row tiles, and the
# step thread's malloc arena"). On an AVX2-only CPU the kernel's avx2 path runs the tiles (every format) and
# the row-major blocks only in scalar code, so there Q6_K of other N is repacked as Q4_K is; its tiles run
# 1.4-2.6x the repacked layout's int8 GEMV / fp32 kernel at 4-128 rows and 1.5-3.4x dequantize + fp32 GEMM at
# 512; one row Q4_K 1.3x, Q6_K 0.8-1.3x (benchmarks/qk_avx2.py, docs/benchmarks-log.md "k-quant tiles on
# AVX2", an AVX2-only CPU simulated on a 2-core Zen 5).
SUPER_BLOCK_TYPES = ("Q6_K", "Q4_K")
# k-quant types the kernel runs only as 16-row tiles (qk_native.cpp's Q5_K / IQ4_XS / Q3_K / Q2_K x16, within
# 1/8 bit per weight of the file's bits): held so under the same switch where N is a multiple of 16, else
# repacked into 8-bit groups (gguf_repack.py: 1.75-3x the file's bits)
TILE_ONLY_TYPES = {"Q5_K": "q5_k", "IQ4_XS": "iq4_xs", "Q3_K": "q3_k", "Q2_K": "q2_k"}
SUPER_BLOCKS_ENV = "KUBEINFER_KQUANT_BLOCKS"


def super_blocks_enabled(compute: torch.dtype) -> bool:
    """KUBEINFER_KQUANT_BLOCKS: `1` hold SUPER_BLOCK_TYPES as super-blocks (and Q8_0, Q5_0, IQ4_NL, Q5_1 and
    TILE_ONLY_TYPES as 16-row tiles), `0` repack them (and keep Q8_0 and the like row-major); unset: where the super-block kernel runs its
    AVX512-VNNI or AVX2 path (its scalar path is slower than the repacked formats' AVX2 GEMV) and the layers'
    GEMMs take int8 activations (`compute`, the GEMM dtype: bf16 or int8, server/quant/gemm_dtype.py; a
    GGUF served as it is under `--dtype auto` gets one of them on every AVX512-VNNI or AVX2 CPU). The tiles'
    int8-activation kernels serve those; fp32 layers dequantize them a row at a time (qk_native.cpp's
    fp32_rows), 10x the row-major kernel's time at one row (Zen 5: a Q8_0 [4096, 2048] 1.89 against 0.18
    ms; a Qwen3-MoE-2.1B Q4_K_M block's experts at one token 18.5 against 1.4 ms), so for fp32 (a file
    read to be dequantized, a CPU without AVX2) the row-major and repacked layouts serve.
    ValueError for another value."""
    explicit = env_switch(SUPER_BLOCKS_ENV)
    if explicit is not None:
        return explicit
    if compute not in INT8_ACTIVATION_DTYPES:
        return False
    kernel = cpu_qk_native.try_load_qk_native_kernel()
    # the features read now too: KUBEINFER_CPU_DISABLE may have changed since the kernel was loaded
    return kernel is not None and kernel.isa in TILE_PATHS and kernel.isa == cpu_qk_native.usable_path()


TILE_PATHS = ("vnni", "avx2")  # qk_native's paths that run the tiles in SIMD code


# 32-value formats held as their 16-row tiles wherever super_blocks_enabled holds the k-quants' (the avx2
# path included), for matrices of whole tiles: at the file's bits per weight, Q5_0 5.5, IQ4_NL 4.5, Q5_1
# 6.0, against the row-major repacks' 8.5, 8.5, 9.0 (cpu_qlinear.interleave_q8_x16); Q8_0 only where
# q8_tiles_enabled (Q8_TILE_FORMATS)
TILE_32_FORMATS = ("q5_0", "iq4_nl", "q5_1")
Q8_TILE_FORMATS = ("q8_0",)


def tiled_32_formats(super_blocks: bool) -> frozenset[str]:
    """The 32-value formats (cpu_qlinear.Q8_TILED's keys) the loader holds as 16-row tiles, given
    super_blocks_enabled: TILE_32_FORMATS, and Q8_TILE_FORMATS where q8_tiles_enabled; none without."""
    if not super_blocks:
        return frozenset()
    return frozenset(TILE_32_FORMATS) | (frozenset(Q8_TILE_FORMATS) if q8_tiles_enabled() else frozenset())


def q8_tiles_enabled() -> bool:
    """Where super_blocks_enabled holds the k-quants' tiles, whether Q8_TILE_FORMATS (Q8_0) of whole tiles
    are held as their tiles too: on the kernel's vnni path, or with KUBEINFER_KQUANT_BLOCKS=1. Not by default
    on its avx2 path, where their kernel runs (tested like the vnni one) but Q8_0's tiles hold the row-major
    layout's 8.5 bits (no CPU without VNNI makes the packed copy) and one row, decode's common case, ran
    0.8-1.15x the row-major int8 GEMV (Q8_0 [8192, 2048] 0.79x; 4-128 rows 1.5-2.4x: benchmarks/qk_avx2.py
    --formats q8_0, simulated AVX2-only CPU, docs/benchmarks-log.md "k-quant tiles on AVX2"). The other
    32-value formats (TILE_32_FORMATS) are tiled there regardless: their tiles hold fewer bits than the
    repack (Q5_0 5.5, IQ4_NL 4.5, Q5_1 6.0 against 8.5, 8.5, 9.0), and their one-row kernel ran 1.05-1.21x
    (Q5_0), 1.22-1.44x (IQ4_NL), 1.17-1.30x (Q5_1) the row-major int8 GEMV, 16 rows 1.7-1.9x, 4 rows
    0.92-1.5x (Llama-3.2-1B's [2048, 2048], [8192, 2048], [2048, 8192], same simulated CPU,
    docs/benchmarks-log.md "IQ4_NL and Q5_1 in 16-row tiles")."""
    return bool(env_switch(SUPER_BLOCKS_ENV)) or _row_major_runs()


def _row_major_runs() -> bool:
    """Whether the kernel runs row-major super-blocks in SIMD code (its vnni path; avx2 runs tiles only)."""
    kernel = cpu_qk_native.try_load_qk_native_kernel()
    return kernel is not None and kernel.isa == "vnni"


# Mixture-of-experts blocks (llama.cpp's Mixtral in the `llama` architecture, qwen2moe, qwen3moe): full
# names under the layer, assembled into server/models/moe/block.py's parameters by the loader. The
# stacked experts (`*_exps`, ggml shape {K, N, E}) are [E, N, K]; the shared expert's gate is {H}.
_MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.router",
    "ffn_gate_exps.weight": "mlp.experts.gate",
    "ffn_up_exps.weight": "mlp.experts.up",
    "ffn_down_exps.weight": "mlp.experts.down",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate",
    "ffn_up_shexp.weight": "mlp.shared_expert.up",
    "ffn_down_shexp.weight": "mlp.shared_expert.down",
    # gpt-oss: the router's and the experts' biases ([E], [E, N])
    "ffn_gate_inp.bias": "mlp.router_bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_bias",
    "ffn_up_exps.bias": "mlp.experts.up_bias",
    "ffn_down_exps.bias": "mlp.experts.down_bias",
}
_EXPERT_NAMES = ("mlp.experts.gate", "mlp.experts.up", "mlp.experts.down")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, layout: GgufLayout = LAYOUTS["llama"]) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight under `layout` (the file's
    architecture: gguf_names.py); None for tensors we do not use (rope_freqs, Phi-3's rope factors:
    the config reader's)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None:
        return None
    moe = _MOE_NAMES.get(f"{m.group(2)}.{m.group(3)}")
    if moe is not None:
        return f"model.layers.{m.group(1)}.{moe}"
    if m.group(2) not in layout.layer:
        return None
    if m.group(2) in layout.parameters:
        return f"model.layers.{m.group(1)}.{layout.layer[m.group(2)]}"
    return f"model.layers.{m.group(1)}.{layout.layer[m.group(2)]}.{m.group(3)}"


def rotary_unpermute(n_rows: int, n_head: int) -> Tensor:  # [n_rows] int64
    """Row order that undoes convert_hf_to_gguf.py's q/k permutation: new[i] = old[perm[i]]."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


@dataclass(frozen=True)
class DequantizedTensor:
    """A GGUF tensor held as fp32 because no kept layout takes its type."""

    name: str  # the GGUF tensor name, e.g. blk.0.attn_q.weight
    gguf_type: str  # e.g. IQ2_XXS, F16
    file_bytes: int  # its bytes in the file
    resident_bytes: int  # the fp32 copy's bytes

    @property
    def extra_bytes(self) -> int:
        """Memory beyond the file's bytes for this tensor (never negative)."""
        return max(0, self.resident_bytes - self.file_bytes)


@dataclass
class GgufCheckpoint:
    architecture: str  # general.architecture, e.g. "llama"
    tensors: dict[str, Tensor | BlockQuantWeight] = field(default_factory=dict)  # HF name -> tensor
    # stacked expert tensors kept quantized: name (model.layers.N.mlp.experts.gate/up/down) -> one
    # [N, K] weight per expert (the dense or dequantized ones are [E, N, K] tensors in `tensors`)
    experts: dict[str, list[BlockQuantWeight]] = field(default_factory=dict)
    # stacked MXFP4 expert tensors (gpt-oss): name -> (blocks [E, N, K / 32, 16], scales [E, N, K / 32])
    # in cpu_mxfp4's layout, moved exactly from ggml's blocks
    mxfp4_experts: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)  # GGUF type name -> tensor count
    dequantized: list[DequantizedTensor] = field(default_factory=list)  # quantized or 16-bit, now fp32
    file_tensor_bytes: int = 0  # bytes of the tensors read (the ones we use), as stored in the file

    def quantized_bytes(self) -> int:
        experts = sum(w.nbytes() for ws in self.experts.values() for w in ws)
        experts += sum(b.numel() + s.numel() for b, s in self.mxfp4_experts.values())
        return experts + sum(t.nbytes() for t in self.tensors.values() if isinstance(t, BlockQuantWeight))


def _field_int(reader: object, key: str) -> int | None:
    f = reader.fields.get(key)  # type: ignore[attr-defined]
    if f is None:
        return None
    return int(f.parts[f.data[0]][0])


def read_gguf_checkpoint(path: Path, compute: torch.dtype) -> GgufCheckpoint:
    """Every tensor of `path` under its Hugging Face name, laid out for layers computing in `compute`
    (super_blocks_enabled); raises ValueError for tensor types it cannot read."""
    from gguf.quants import dequantize

    from server.gguf_file import open_gguf

    reader = open_gguf(path, long_arrays=False)
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "llama"
    layout = LAYOUTS.get(arch)
    if layout is None:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not mapped; expected one of {sorted(LAYOUTS)}"
        )
    n_head = _field_int(reader, f"{arch}.attention.head_count")
    n_kv = _field_int(reader, f"{arch}.attention.head_count_kv") or n_head
    ckpt = GgufCheckpoint(arch)
    super_blocks = super_blocks_enabled(compute)
    tiled_32 = tiled_32_formats(super_blocks)
    for t in reader.tensors:
        name = hf_name(t.name, layout)
        if name is None:
            continue
        kind = t.tensor_type.name
        ckpt.formats[kind] = ckpt.formats.get(kind, 0) + 1
        shape = [int(s) for s in reversed(t.shape.tolist())]  # ggml ne order -> [N, K]
        ckpt.file_tensor_bytes += int(t.n_bytes)
        value: Tensor | BlockQuantWeight
        kept = kind in _KEPT or kind in _KEPT_K or kind in REPACKED
        if len(shape) == 3 and name.endswith(_EXPERT_NAMES) and kept:
            ckpt.experts[name] = _split_experts(t.data, kind, shape, super_blocks, tiled_32)
            continue
        if len(shape) == 3 and name.endswith(_EXPERT_NAMES) and kind == "MXFP4":
            with warnings.catch_warnings():  # a read-only memory map: from_gguf_mxfp4 copies what it keeps
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.as_tensor(np.ascontiguousarray(t.data)).view(torch.uint8)
            ckpt.mxfp4_experts[name] = from_gguf_mxfp4(raw, (shape[0], shape[1], shape[2]))
            continue
        # MoE block tensors stay row-major (the experts' code reads the repacked layout); a shared expert's
        # ffn_*_shexp are plain projections (SparseMoeBlock.set_shared_expert) and take tiles as any
        moe = any(name.endswith(v) for v in _MOE_NAMES.values()) and ".shared_expert." not in name
        if kind in _KEPT and len(shape) == 2:
            # t.data is a view of the file's memory map: only the repacked copies stay resident.
            value = from_gguf_blocks(t.data, _KEPT[kind], shape[0], shape[1])
        elif kind in _KEPT_K and len(shape) == 2:
            value = _k_quant(t.data, kind, shape[0], shape[1], super_blocks and not moe)
        elif kind in REPACKED and len(shape) == 2:
            value = _repacked(t.data, kind, shape[0], shape[1], super_blocks and not moe)
        elif kind in _FLOAT:
            value = torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(shape)
            if kind != "F32":
                ckpt.dequantized.append(DequantizedTensor(t.name, kind, int(t.n_bytes), value.nbytes))
        else:
            try:
                value = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(shape)
            except NotImplementedError as e:
                raise ValueError(f"{path.name}: tensor {t.name} has type {kind}, which cannot be read") from e
            ckpt.dequantized.append(DequantizedTensor(t.name, kind, int(t.n_bytes), value.nbytes))
        if ckpt.dequantized and ckpt.dequantized[-1].name == t.name:
            d = ckpt.dequantized[-1]
            log.warning(
                "%s: %s (%s) is served as fp32: %d bytes resident, %d more than in the file",
                path.name,
                t.name,
                kind,
                d.resident_bytes,
                d.extra_bytes,
            )
        if layout.norm_shift and t.name.endswith("norm.weight") and isinstance(value, Tensor):
            value = value - layout.norm_shift
        if layout.permute_qk and n_head and (".q_proj." in name or ".k_proj." in name):
            heads = n_head if ".q_proj." in name else n_kv
            assert heads is not None
            perm = rotary_unpermute(shape[0], heads)
            value = (
                value.select_rows(perm) if isinstance(value, BlockQuantWeight) else value[perm].contiguous()
            )
        if isinstance(value, BlockQuantWeight) and _tileable(value, frozenset() if moe else tiled_32):
            # after the row permutation: tiles are 16 rows as served
            value = interleave_x16(value) if value.super_blocks else interleave_q8_x16(value)
        ckpt.tensors[name] = value
    del reader  # unmaps the file
    release_free_heap()
    return ckpt


def _tileable(w: BlockQuantWeight, tiled_32: frozenset[str] = frozenset()) -> bool:
    """Super-blocks of whole 16-row tiles, or 32-blocks of a format in `tiled_32` (tiled_32_formats) that
    its 16-row tiles hold (cpu_qlinear.q8_tileable): held as tiles once their rows are final."""
    if w.super_blocks:
        return w.fmt in cpu_qk_native.TILED and w.out_features % X16_ROWS == 0
    return w.fmt in tiled_32 and q8_tileable(w)


def _k_quant(raw: np.ndarray | Tensor, kind: str, n: int, k: int, super_blocks: bool) -> BlockQuantWeight:
    """A Q4_K / Q6_K matrix [N, K] as served: SUPER_BLOCK_TYPES held as the file's super-blocks where
    `super_blocks` (Q4_K only with N a multiple of 16, Q6_K too where they would run row-major in scalar
    code, `_row_major_runs`; both become 16-row tiles once their rows are final, `_tileable`,
    `interleave_x16`), else repacked."""
    whole_tiles = n % X16_ROWS == 0
    if super_blocks and kind in SUPER_BLOCK_TYPES and (whole_tiles or (kind == "Q6_K" and _row_major_runs())):
        return from_gguf_k_super_blocks(raw, _KEPT_K[kind], n, k)
    return from_gguf_k_blocks(raw, _KEPT_K[kind], n, k)


def _repacked(raw: np.ndarray | Tensor, kind: str, n: int, k: int, super_blocks: bool) -> BlockQuantWeight:
    """A matrix [N, K] of a REPACKED type as served: TILE_ONLY_TYPES as the file's super-blocks where
    `super_blocks` and N is a multiple of 16 (tiled once their rows are final, `_tileable`), else repacked
    exactly into 8-bit groups (gguf_repack.py)."""
    if (
        super_blocks
        and kind in TILE_ONLY_TYPES
        and n % X16_ROWS == 0
        # only the compiled library writes these tiles: where it cannot be built (KUBEINFER_KQUANT_BLOCKS=1
        # forced without a compiler) the repack serves, as the torch re-lay serves Q4_K / Q6_K there
        and cpu_qk_native.try_load_qk_native_kernel() is not None
    ):
        return from_gguf_k_super_blocks(raw, TILE_ONLY_TYPES[kind], n, k)
    return from_gguf_repacked(raw, kind, n, k)


def _split_experts(
    raw: np.ndarray, kind: str, shape: list[int], super_blocks: bool, tiled_32: frozenset[str]
) -> list[BlockQuantWeight]:
    """A stacked expert tensor [E, N, K] of a kept type -> one BlockQuantWeight [N, K] per expert: the
    file holds the E matrices one after the other, each rows of ggml blocks. k-quants as `_k_quant` holds
    them; 16-row tiles where a dense matrix of the type takes them (`_tileable`: tiled here, expert rows
    are never permuted)."""
    e, n, k = shape
    with warnings.catch_warnings():  # a read-only memory map: the converters below copy what they keep
        warnings.simplefilter("ignore", UserWarning)
        data = torch.as_tensor(np.ascontiguousarray(raw)).view(torch.uint8).reshape(e, -1)
    out: list[BlockQuantWeight] = []
    for i in range(e):
        if kind in _KEPT:
            w = from_gguf_blocks(data[i], _KEPT[kind], n, k)
        elif kind in _KEPT_K:
            w = _k_quant(data[i], kind, n, k, super_blocks)
        else:
            w = _repacked(data[i].reshape(n, -1), kind, n, k, super_blocks)
        if _tileable(w, tiled_32):  # the 32-value formats as their tiles where tiled_32_formats says
            w = interleave_x16(w) if w.super_blocks else interleave_q8_x16(w)
        out.append(w)
    return out
