"""A whole decode step's decoder layers in one compiled call (CPU, fp32, block-quantized projections).

The KV cache may be fp32, bf16 or fp16 (--kv-cache-dtype): the graph records its dtype and writes K/V
through the attention library's `kubeinfer_kv_store`, which rounds as the Python path's `.to()` does.

Under bf16 GEMMs (server/quant/gemm_dtype.py) it serves decode batches below BF16_GEMM_MIN_ROWS
(`DecodeGraph.max_rows`) with each weight descriptor's `compute` flag set from its projection's
gemm_dtype, so that the kernel runs batches of 4..255 rows on its bf16 batched path (AVX512-BF16; the
GEMV of 1..3 rows stays fp32), exactly as BlockQuantLinear does from Python; larger batches go through
the Python path, whose projections then run their bf16 dequantize + GEMM. The projections' entry point
is the int8-activation library's where either of its switches is on (cpu_qgemv_q8.decode_entry, its
modes recorded with it and restored before each replay): with KUBEINFER_INT8_GEMM (default on) on an
AVX512-VNNI CPU, batches of 5+ rows of 4- or 8-bit weights run its batched int8 path, and where the int8
GEMV is on (by default: bf16 layers on CPUs with AMX-INT8) its 1..4-row GEMV; the rest goes on to qlinear
as above.

On this machine a one-token step of the embedded SmolLM2 spends ~8 ms in its 121 weight kernels and ~9 ms
in Python around them: module calls, argument checks and ctypes marshalling, ~300 us per layer. Like a
CUDA graph, `DecodeGraph` records once what never changes (every layer's weight descriptors, norms, KV
cache pointers and the kernels' entry points) and replays the layer loop in C++
(`kubeinfer_decode_forward`, server/models/csrc/cpu_fused.cpp) calling the same kernels in the same
order on the same buffers as `LlamaForCausalLM._forward_fused`: the hidden states are bit-identical.
Qwen3's q/k norms run in it too (`kubeinfer_head_rms_norm`, as in the Python fused path).

It serves steps whose every row is a one-token decode (no prefill chunk, no speculative verification)
of a model whose q/k/v, o, gate/up and down are plain `BlockQuantLinear` with the compiled kernel (a
GGUF or a `--quantize`d checkpoint on CPU, not LoRA-wrapped or tensor-parallel) under the compiled
decode attention; `build` returns None for anything else and the Python path serves it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from server.attention import AttentionBackend, AttentionMetadata
from server.attention.cpu_kernel import CACHE_DTYPE_CODES, check_decode_indices
from server.attention.torch_backend import TorchAttentionBackend
from server.models.arch import ArchConfig
from server.models.cpu_fused import FusedOps
from server.models.layers import DecoderLayer, RMSNorm
from server.quant.block_linear import GEMM_MIN_ROWS, BlockQuantLinear
from server.quant.cpu_qgemv_q8 import DecodeEntry, decode_entry
from server.quant.cpu_qlinear import BlockQuantWeight, KiQWeight, compute_flag, weight_descriptor

_ptr, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _ptr),
        ("qkv_bias", _ptr),
        ("o", _ptr),
        ("o_bias", _ptr),
        ("gate_up", _ptr),
        ("gate_up_bias", _ptr),
        ("down", _ptr),
        ("down_bias", _ptr),
        ("norm1", _ptr),
        ("norm2", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("eps1", _f32),
        ("eps2", _f32),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("qk_eps", _f32),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _ptr),
        ("num_layers", _i64),
        ("final_norm", _ptr),
        ("final_eps", _f32),
        ("scale", _f32),
        ("hidden", _i64),
        ("inter", _i64),
        ("hq", _i64),
        ("hkv", _i64),
        ("d", _i64),
        ("block_size", _i64),
        ("qlinear", _ptr),
        ("paged_decode", _ptr),
        ("kv_store", _ptr),
        ("cache_dtype", _i32),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("h", _ptr),
        ("out", _ptr),
        ("t", _i64),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("bt_stride", _i64),
        ("context_lens", _ptr),
        ("seqs", _ptr),
        ("x", _ptr),
        ("qkv", _ptr),
        ("attn", _ptr),
        ("gate_up", _ptr),
        ("act", _ptr),
        ("delta", _ptr),
        ("threads", _i32),
    ]


def _bias(m: BlockQuantLinear) -> int | None:
    return None if m.bias is None else m.bias.data_ptr()


def _qk_norm_fields(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple[int | None, int | None, float]:
    if q_norm is None or k_norm is None:
        return None, None, 0.0
    assert q_norm.eps == k_norm.eps  # both built from rms_norm_eps (llama.py's Attention)
    return q_norm.weight.data_ptr(), k_norm.weight.data_ptr(), q_norm.eps


def _fn_address(fn: Any) -> int:  # a ctypes function of a loaded library -> its entry point
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address is not None
    return int(address)


@dataclass
class DecodeGraph:
    """The recorded layer loop; `run` replays it for one pure-decode step."""

    # BlockQuantLinear sends M >= GEMM_MIN_ROWS to dequantize + torch GEMM, the graph always to the kernel:
    # above this the two paths would sum in different orders, so the Python path serves such steps.
    # With bf16 GEMMs (gemm_dtype.py) the bound is lower, BF16_GEMM_MIN_ROWS - 1 (`max_rows`): larger
    # pure-decode batches go through the Python path and its bf16 GEMMs. Below it the graph calls the
    # kernel with each projection's compute flag: bf16 batches of 4..255 rows run the kernel's bf16
    # path, the same call BlockQuantLinear makes (benchmarks/cpu_qlinear.py `bf16`).
    MAX_ROWS: ClassVar[int] = GEMM_MIN_ROWS - 1

    ops: FusedOps
    model_struct: _Model
    cache_shape: torch.Size  # [num_blocks, block_size, Hkv, D] of every layer's K and V cache
    dims: tuple[int, int, int, int, int]  # hidden, inter, Hq, Hkv, D
    projections: list[list[BlockQuantLinear]]  # per layer: qkv, o, gate_up, down
    descriptors: list[KiQWeight]  # the projections' descriptors, in the same order (flattened)
    entry: DecodeEntry  # the projections' entry point and the int8 modes recorded with it
    # Kept alive: the C side holds raw pointers into these.
    _keep: tuple[object, ...]
    # BlockQuantLinear.gemm_dtype_changes when the compute flags and `max_rows` were last read from the
    # projections (apply_gemm_dtype may run after recording); -1: never.
    _synced_changes: int = -1
    _max_rows: int = 0

    @staticmethod
    def build(
        layers: list[DecoderLayer],
        final_norm: RMSNorm,
        config: ArchConfig,
        # per layer: 2 x [num_blocks, block_size, Hkv, D], fp32, bf16 or fp16 (--kv-cache-dtype)
        kv_caches: list[tuple[Tensor, Tensor]],
        backend: AttentionBackend,
        ops: FusedOps,
    ) -> DecodeGraph | None:
        """The graph for these layers, caches and backend, or None where the Python path must serve:
        the layer contract it runs is the Llama layer (`LayerSpec.is_llama`) with Qwen3's per-head
        q/k norm at most; any other spec returns None."""
        if not isinstance(backend, TorchAttentionBackend) or backend.decode_kernel is None:
            return None
        if not config.is_llama:
            return None
        if not layers or len(layers) != len(kv_caches):
            return None
        # The recorded graph calls the whole-context decode entry point: windowed layers take the Python path.
        if any(layer.self_attn.sliding_window is not None for layer in layers):
            return None
        projections: list[list[BlockQuantLinear]] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            mods = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            # exact type: a LoRA- or tensor-parallel-wrapped projection computes more than the kernel
            if not all(type(m) is BlockQuantLinear and m.kernel is not None for m in mods):
                return None
            projections.append([m for m in mods if isinstance(m, BlockQuantLinear)])
        kernel = projections[0][0].kernel
        if kernel is None or any(m.kernel is not kernel for mods in projections for m in mods):
            return None
        norms = [layer.input_layernorm.weight for layer in layers] + [
            layer.post_attention_layernorm.weight for layer in layers
        ]
        norms.append(final_norm.weight)
        qk_norms = [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers]
        norms.extend(n.weight for pair in qk_norms for n in pair if n is not None)
        if any(
            (q is None) != (k is None) or (q is not None and q.weight.shape != (config.head_dim,))
            for q, k in qk_norms
        ):
            return None
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        k0 = kv_caches[0][0]
        shape = k0.shape
        if k0.dtype not in CACHE_DTYPE_CODES:
            return None
        if any(
            c.dtype != k0.dtype or c.shape != shape or not c.is_contiguous() for kv in kv_caches for c in kv
        ):
            return None
        attn0, cfg = layers[0].self_attn, config
        hq, hkv, d = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        descriptors: list[KiQWeight] = []
        kept_weights: list[BlockQuantWeight] = []
        structs = (_Layer * len(layers))()
        for i, (layer, (kc, vc), linears) in enumerate(zip(layers, kv_caches, projections, strict=True)):
            qkv, o, gate_up, down = linears
            want = ((qkv, hidden, (hq + 2 * hkv) * d), (o, hq * d, hidden), (gate_up, hidden, 2 * inter))
            if any((m.in_features, m.out_features) != (k, n) for m, k, n in want) or (
                down.in_features,
                down.out_features,
            ) != (inter, hidden):
                return None
            weights = [m.weight_q for m in linears]
            kept_weights.extend(weights)  # the descriptors point into their tensors
            descs = [weight_descriptor(w, m.gemm_dtype) for w, m in zip(weights, linears, strict=True)]
            descriptors.extend(descs)
            structs[i] = _Layer(
                ctypes.addressof(descs[0]),
                _bias(qkv),
                ctypes.addressof(descs[1]),
                _bias(o),
                ctypes.addressof(descs[2]),
                _bias(gate_up),
                ctypes.addressof(descs[3]),
                _bias(down),
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                kc.data_ptr(),
                vc.data_ptr(),
                layer.input_layernorm.eps,
                layer.post_attention_layernorm.eps,
                *_qk_norm_fields(layer.self_attn.q_norm, layer.self_attn.k_norm),
            )
        final = final_norm
        entry = decode_entry(kernel)  # int8-activation entry or qlinear (cpu_qgemv_q8.py)
        model_struct = _Model(
            ctypes.addressof(structs),
            len(layers),
            final.weight.data_ptr(),
            final.eps,
            attn0.scale,
            hidden,
            inter,
            hq,
            hkv,
            d,
            shape[1],
            entry.address,
            _fn_address(backend.decode_kernel.lib.kubeinfer_paged_decode),
            _fn_address(backend.decode_kernel.lib.kubeinfer_kv_store),
            CACHE_DTYPE_CODES[k0.dtype],
        )
        return DecodeGraph(
            ops=ops,
            model_struct=model_struct,
            cache_shape=shape,
            dims=(hidden, inter, hq, hkv, d),
            projections=projections,
            descriptors=descriptors,
            entry=entry,
            _keep=(descriptors, kept_weights, structs, norms, projections, kv_caches),
        )

    @property
    def max_rows(self) -> int:
        """The most rows this graph serves: below every projection's `gemm_min_rows` (as the
        projections' gemm_dtype is now, so a gemm_dtype set after recording is honoured)."""
        self.sync_compute()
        return self._max_rows

    def sync_compute(self) -> None:
        """Sets each descriptor's compute flag from its projection's gemm_dtype, and `max_rows`, where any
        gemm_dtype was assigned since the last sync; run before every step."""
        if self._synced_changes == BlockQuantLinear.gemm_dtype_changes:
            return
        modules = [m for mods in self.projections for m in mods]
        for desc, m in zip(self.descriptors, modules, strict=True):
            flag = compute_flag(m.gemm_dtype)
            if desc.compute != flag:
                desc.compute = flag
        self._max_rows = min(m.gemm_min_rows for m in modules) - 1
        self._synced_changes = BlockQuantLinear.gemm_dtype_changes

    @property
    def num_cache_slots(self) -> int:  # num_blocks * block_size
        return self.cache_shape[0] * self.cache_shape[1]

    def run(
        self,
        h: Tensor,  # [T, hidden] fp32 contiguous, the embeddings; becomes the residual stream
        cos: Tensor,  # [T, D] fp32 contiguous
        sin: Tensor,  # [T, D] fp32 contiguous
        meta: AttentionMetadata,  # T sequences of one new token each
    ) -> Tensor:  # [T, hidden] fp32: the final norm's output
        hidden, inter, hq, hkv, d = self.dims
        t = h.shape[0]
        if meta.num_seqs != t or meta.max_query_len != 1:
            raise ValueError("the decode graph runs pure-decode steps only (one new token per sequence)")
        if h.dtype != torch.float32 or tuple(h.shape) != (t, hidden) or not h.is_contiguous():
            raise ValueError(f"h must be a contiguous [T, {hidden}] fp32 tensor")
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dtype != torch.float32 or tuple(table.shape) != (t, d) or not table.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [{t}, {d}] fp32 tensor")
        slots, tables, ctx = meta.slot_mapping, meta.block_tables, meta.context_lens
        if slots.dtype != torch.int64 or tuple(slots.shape) != (t,) or not slots.is_contiguous():
            raise ValueError("slot_mapping must be a contiguous [T] int64 tensor")
        if tables.dtype != torch.int32 or tables.dim() != 2 or not tables.is_contiguous():
            raise ValueError("block_tables must be a contiguous [T, max_blocks] int32 tensor")
        if ctx.dtype != torch.int32 or not ctx.is_contiguous():
            raise ValueError("context_lens must be a contiguous int32 tensor")
        if t and (int(slots.min()) < 0 or int(slots.max()) >= self.num_cache_slots):
            raise ValueError("slot_mapping: slot out of range of the cache")
        seqs = torch.arange(t, dtype=torch.int64)
        self.sync_compute()
        self.entry.restore()
        check_decode_indices(t, self.cache_shape, tables, ctx, seqs, seqs)
        out = torch.empty(t, hidden)
        scratch = torch.empty(t, 2 * hidden + (hq + 2 * hkv) * d + hq * d + 3 * inter)
        # x, qkv, attn, gate_up, act, delta: consecutive [T, width] fp32 blocks of one allocation
        base, step_ptrs, position = scratch.data_ptr(), [], 0
        for width in (hidden, (hq + 2 * hkv) * d, hq * d, 2 * inter, inter, hidden):
            step_ptrs.append(base + 4 * position * t)
            position += width
        x, qkv, attn, gate_up, act, delta = step_ptrs
        step = _Step(
            h.data_ptr(),
            out.data_ptr(),
            t,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            ctx.data_ptr(),
            seqs.data_ptr(),
            x,
            qkv,
            attn,
            gate_up,
            act,
            delta,
            torch.get_num_threads(),
        )
        rc = self.ops.lib.kubeinfer_decode_forward(ctypes.byref(self.model_struct), ctypes.byref(step))
        if rc != 0:
            raise RuntimeError(f"decode graph returned {rc} (the hundreds say which op of a layer failed)")
        return out


def cache_pointers(kv_caches: list[tuple[Tensor, Tensor]]) -> tuple[int, ...]:
    """What a recorded graph must still find: a cache reallocated means a new recording."""
    return tuple(c.data_ptr() for kv in kv_caches for c in kv)
