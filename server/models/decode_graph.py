"""A whole decode step's decoder layers in one compiled call (CPU, fp32, block-quantized projections).

The KV cache may be fp32, bf16, fp16 or int8 (--kv-cache-dtype): the graph records its dtype and writes K/V
through the attention library's `kubeinfer_kv_store`, which rounds as the Python path's `.to()` does (and
quantizes an int8 cache as the Python path's store, the same function, does).

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
Qwen3's q/k norms run in it too (`kubeinfer_head_rms_norm`, as in the Python fused path), and Gemma 2's
soft-capped attention (the attention library's `kubeinfer_paged_decode_capped`, which the Python fused
path reaches through the backend with the layer's `softcap`); the final logit soft-cap stays in `compute_logits`, after either path.

It serves steps whose every row is a one-token decode (no prefill chunk, no speculative verification)
of a model whose q/k/v, o, gate/up and down are plain `BlockQuantLinear` with the compiled kernel (a
GGUF or a `--quantize`d checkpoint on CPU, not LoRA-wrapped or tensor-parallel) under the compiled
decode attention; `build` returns None for anything else and the Python path serves it.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from server.attention import AttentionBackend, AttentionMetadata
from server.attention.cpu_kernel import CACHE_DTYPE_CODES, _cache_layout_ok, check_decode_indices
from server.attention.torch_backend import TorchAttentionBackend
from server.models.arch import ArchConfig
from server.models.cpu_fused import FusedOps
from server.models.layer_spec import LayerSpec
from server.models.layers import MLP, DecoderLayer, RMSNorm
from server.models.moe.block import SparseMoeBlock
from server.models.moe.config import MoEConfig
from server.models.moe.layer import FusedMoE
from server.models.moe.native import FusedExpertsCall
from server.quant.block_linear import GEMM_MIN_ROWS, BlockQuantLinear
from server.quant.cpu_qgemv_q8 import DecodeEntry, decode_entry
from server.quant.cpu_qlinear import BlockQuantWeight, KiQWeight, compute_flag, weight_descriptor

log = logging.getLogger(__name__)

_ptr, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class _Layer(ctypes.Structure):  # cpu_fused.cpp's KiDecodeLayer
    _fields_ = [
        ("qkv", _ptr),
        ("qkv_bias", _ptr),
        ("k_proj", _ptr),
        ("k_bias", _ptr),
        ("v_proj", _ptr),
        ("v_bias", _ptr),
        ("o", _ptr),
        ("o_bias", _ptr),
        ("gate_up", _ptr),
        ("gate_up_bias", _ptr),
        ("down", _ptr),
        ("down_bias", _ptr),
        ("attn_in_norm", _ptr),
        ("attn_out_norm", _ptr),
        ("mlp_in_norm", _ptr),
        ("mlp_out_norm", _ptr),
        ("attn_in_eps", _f32),
        ("attn_out_eps", _f32),
        ("mlp_in_eps", _f32),
        ("mlp_out_eps", _f32),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("qk_norm", _i32),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("qk_eps", _f32),
        ("rope", _i32),
        ("rotary_dim", _i32),
        ("scale", _f32),
        ("window", _i32),
        ("sinks", _ptr),
        ("residual_mult", _f32),
        ("activation", _i32),
        ("attn_softcap", _f32),
        ("kv_group", _i32),
        ("moe", _ptr),
    ]


class _Moe(ctypes.Structure):  # cpu_fused.cpp's KiDecodeMoe
    _fields_ = [
        ("router", _ptr),
        ("router_bias", _ptr),
        ("num_experts", _i64),
        ("top_k", _i64),
        ("routing", _i32),
        ("renormalize", _i32),
        ("experts", _ptr),
        ("shared_gate_up", _ptr),
        ("shared_down", _ptr),
        ("shared_gate", _ptr),
        ("shared_inter", _i64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _ptr),
        ("num_layers", _i64),
        ("final_norm", _ptr),
        ("final_eps", _f32),
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
        ("moe_experts", _ptr),
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
        ("slots_g1", _ptr),
        ("block_tables_g1", _ptr),
        ("bt_stride_g1", _i64),
        ("router_logits", _ptr),
        ("expert_ids", _ptr),
        ("expert_weights", _ptr),
        ("shared_out", _ptr),
    ]


def _bias(m: BlockQuantLinear) -> int | None:
    return None if m.bias is None else m.bias.data_ptr()


def _fn_address(fn: Any) -> int:  # a ctypes function of a loaded library -> its entry point
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address is not None
    return int(address)


_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_QK_NORMS = {"none": 0, "head": 1, "full": 2}
_refusals_logged: set[str] = set()


def _refuse(reason: str) -> None:
    """build returns None: the reason logged once per process (a new recording follows every cache change)."""
    if reason not in _refusals_logged:
        _refusals_logged.add(reason)
        log.info("decode graph not recorded, the Python fused path serves decode steps: %s", reason)


def layer_refusal(spec: LayerSpec, moe: MoEConfig | None = None) -> str | None:
    """What of this layer kind the compiled graph cannot run yet, or None: every field of the layer
    contract is data in the graph's layer record (Gemma 2's attention soft-cap too: the attention library's
    decode kernel takes it, as the Python fused path's backend call does). A mixture-of-experts
    MLP (`moe`: the model's ArchConfig.moe) runs as the record's KiDecodeMoe: an fp32 router GEMV (plus
    gpt-oss's router bias), softmax then top-k with Mixtral's / Qwen3's renormalisation or gpt-oss's
    top-k of the logits then a softmax over them (exact ties to the lowest index: cpu_fused.cpp's
    moe_route; torch.topk promises no order among equal values), the experts' native call
    (moe_experts.cpp: SiLU or gpt-oss's clamped SwiGLU, expert biases, MXFP4 or block-quantized
    weights) and Qwen2-MoE's shared expert (its two projections through the qlinear entry, its sigmoid
    gate in fp32; `build` refuses one held in float weights)."""
    if spec.mlp == "moe":
        if moe is None:
            return "a 'moe' MLP without the model's MoE config"
        if moe.routing not in _ROUTINGS:
            return f"MoE routing {moe.routing!r}"
    elif spec.mlp != "dense":
        return f"a {spec.mlp!r} MLP runs its own block"
    if spec.activation not in _ACTIVATIONS:
        return f"activation {spec.activation!r}"
    return None


_ROUTINGS = {"softmax_topk": 0, "topk_softmax": 1}  # cpu_fused.cpp's KiDecodeMoe.routing


def _moe_struct(router: Tensor, bias: Tensor | None, cfg: MoEConfig, experts: int | None) -> _Moe:
    """A KiDecodeMoe: `router` [E, H] and `bias` [E] (or None) fp32 contiguous, kept alive by the caller;
    `experts` a KiMoeExperts address or None. No shared expert: `build` fills those fields once its
    projections' descriptors exist."""
    return _Moe(
        router.data_ptr(),
        None if bias is None else bias.data_ptr(),
        cfg.num_experts,
        cfg.top_k,
        _ROUTINGS[cfg.routing],
        int(cfg.renormalize),
        experts,
    )


def _experts_call(block: SparseMoeBlock) -> tuple[FusedExpertsCall, FusedMoE] | None:
    """The block's native experts call with the entry point FusedMoE.forward hands it (the int8 GEMV where
    its switch is on), and the fused block it came from (kept alive with it); None without one."""
    fused = block.fused()
    call = fused.native_call()
    if call is None:
        return None
    call.spec.qlinear = fused.experts.fused_entry()  # type: ignore[attr-defined]  # native_call checked it
    return call, fused


def _shared_projections(block: SparseMoeBlock) -> list[Any] | None:
    """The block's shared expert's [gate_up, down] projections ([] for a block without one); None for one
    held in float weights (a GGUF's F16, or --dtype without --quantize), which the graph does not run."""
    if not block.cfg.shared_expert_intermediate_size:
        return []
    mods = [block.shared_gate_up, block.shared_down]
    return None if any(m is None for m in mods) else mods


def _moe_record(block: SparseMoeBlock, hidden: int, kept: list[object]) -> _Moe | None:
    """The block's KiDecodeMoe, or None where its experts have no native call (dense or CUDA experts,
    KUBEINFER_MOE_FUSED=0) or its router (or shared expert's gate) is not an fp32 [E, hidden] ([1,
    hidden]) tensor. A shared expert's gate and size are set here, its projections by `build`."""
    bound = _experts_call(block)
    if bound is None or bound[0].spec.hidden != hidden:
        return None
    call, fused = bound
    router, cfg = fused.weights.router, block.cfg
    if router.dtype != torch.float32 or tuple(router.shape) != (cfg.num_experts, hidden):
        return None
    router = router.contiguous()
    bias = fused.weights.router_bias
    if bias is not None:  # gpt-oss's
        if bias.dtype != torch.float32 or tuple(bias.shape) != (cfg.num_experts,):
            return None
        bias = bias.contiguous()
        kept.append(bias)
    record = _moe_struct(router, bias, cfg, ctypes.addressof(call.spec))
    shared = fused.weights.shared
    if shared is not None:
        if shared.gate.dtype != torch.float32 or tuple(shared.gate.shape) != (1, hidden):
            return None
        gate = shared.gate.reshape(hidden).contiguous()
        kept.append(gate)
        record.shared_gate = gate.data_ptr()
        record.shared_inter = cfg.shared_expert_intermediate_size
    kept.extend((router, call, fused))
    return record


def route(
    ops: FusedOps,
    router: Tensor,  # [E, H] fp32 contiguous
    cfg: MoEConfig,
    x: Tensor,  # [T, H] fp32 contiguous
    bias: Tensor | None = None,  # [E] fp32, where cfg.router_bias
) -> tuple[
    Tensor, Tensor, Tensor
]:  # probabilities (topk_softmax: the biased logits) [T, E] fp32, ids [T, top_k] int64, weights [T, top_k] fp32
    """The graph's router (cpu_fused.cpp's kubeinfer_moe_route) on its own, as routing.select_experts:
    for tests and benchmarks. Raises ValueError for shapes or dtypes it does not take."""
    t, h = x.shape
    if (
        x.dtype != torch.float32
        or router.dtype != torch.float32
        or tuple(router.shape) != (cfg.num_experts, h)
    ):
        raise ValueError(f"x [T, H] and router [{cfg.num_experts}, H] must be fp32")
    if cfg.router_bias != (bias is not None):
        raise ValueError(f"router bias given: {bias is not None}, the config's: {cfg.router_bias}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (cfg.num_experts,)):
        raise ValueError(f"bias must be [{cfg.num_experts}] fp32")
    x, router = x.contiguous(), router.contiguous()
    bias = None if bias is None else bias.contiguous()  # held here while the call reads it
    record = _moe_struct(router, bias, cfg, None)
    probs = torch.empty(t, cfg.num_experts)
    ids = torch.empty(t, cfg.top_k, dtype=torch.int64)
    weights = torch.empty(t, cfg.top_k)
    rc = ops.lib.kubeinfer_moe_route(
        ctypes.byref(record),
        x.data_ptr(),
        t,
        h,
        h,
        probs.data_ptr(),
        ids.data_ptr(),
        weights.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"kubeinfer_moe_route returned {rc}")
    return probs, ids, weights


def _moe_entry(kept: list[object]) -> int | None:
    """kubeinfer_moe_experts's address (the library the blocks' calls loaded), None without MoE layers.
    A function pointer, as for the projections and the attention: one build of each library, loaded once,
    and cpu_fused.cpp needs no link-time dependency on moe_experts.cpp."""
    calls = [c for c in kept if isinstance(c, FusedExpertsCall)]
    return _fn_address(calls[0].kernel.lib.kubeinfer_moe_experts) if calls else None


def _norm_field(norm: RMSNorm | None, kept: list[Tensor]) -> tuple[int | None, float]:
    if norm is None:
        return None, 0.0
    w = norm.applied_weight()  # Gemma's 1 + w, computed once
    kept.append(w)
    return w.data_ptr(), norm.eps


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
    cache_shape: torch.Size  # [num_blocks, block_size, Hkv, D] of every layer's K and V cache (KV group 0)
    # KV group 1's [num_blocks, block_size, Hkv, D] (windowed layers beside global ones), None: one group
    group1_cache_shape: torch.Size | None
    dims: tuple[int, int, int, int, int]  # hidden, inter, Hq, Hkv, D
    rotary_dims: tuple[int, ...]  # per rotary table `run` takes: its width R
    # per layer: qkv (or q, k, v), o, then the MLP's gate_up, down (an MoE layer's shared expert's, or none)
    projections: list[list[BlockQuantLinear]]
    descriptors: list[KiQWeight]  # the projections' descriptors, in the same order (flattened)
    entry: DecodeEntry  # the projections' entry point and the int8 modes recorded with it
    moes: list[_Moe | None]  # per layer: its MoE record, None for a dense MLP
    moe_blocks: list[SparseMoeBlock | None]  # per layer: the block the record was made from
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
        rope_indices: list[int] | None = None,  # per layer: its table in `run`'s tables, -1: no RoPE
    ) -> DecodeGraph | None:
        """The graph for these layers, caches and backend, or None (the reason logged once) where the
        Python path must serve: any layer kind of the contract (`layer_refusal` says what is not),
        block-quantized projections with the compiled kernel, the compiled decode attention."""
        if not isinstance(backend, TorchAttentionBackend) or backend.decode_kernel is None:
            return None
        if not layers or len(layers) != len(kv_caches):
            return None
        rope_indices = rope_indices if rope_indices is not None else [0] * len(layers)
        if len(rope_indices) != len(layers):
            raise ValueError(f"rope_indices: {len(rope_indices)} entries for {len(layers)} layers")
        for layer in layers:
            reason = layer_refusal(layer.spec, config.moe)
            if reason is not None:
                _refuse(f"{config.architecture}: {reason}")
                return None
        projections: list[list[BlockQuantLinear]] = []
        moes: list[_Moe | None] = []
        attn_counts: list[int] = []  # per layer: how many of its projections are attention's (2 or 4)
        kept_moe: list[object] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            # q, k and v apart where their formats differ (a Q4_K_M GGUF's Q6_K or Q8_0 attn_v): the graph
            # writes them into the columns of one qkv buffer
            qkv_mods = (
                [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
            )
            if isinstance(mlp, SparseMoeBlock):
                record = _moe_record(mlp, config.hidden_size, kept_moe)
                if record is None:
                    _refuse(f"{config.architecture}: MoE experts without a native call or an fp32 router")
                    return None
                shared = _shared_projections(mlp)
                if shared is None:
                    _refuse(f"{config.architecture}: a shared expert held in float weights")
                    return None
                moes.append(record)
                mlp_mods: list[Any] = shared  # the shared expert's gate_up and down, or none
            else:
                assert isinstance(mlp, MLP)  # layer_refusal: a dense or an MoE MLP
                moes.append(None)
                mlp_mods = [mlp.gate_up_proj, mlp.down_proj]
            mods = [*qkv_mods, attn.o_proj, *mlp_mods]
            attn_counts.append(len(qkv_mods) + 1)
            # exact type: a LoRA- or tensor-parallel-wrapped projection computes more than the kernel
            if not all(type(m) is BlockQuantLinear and m.kernel is not None for m in mods):
                return None
            projections.append([m for m in mods if isinstance(m, BlockQuantLinear)])
        kernel = projections[0][0].kernel
        if kernel is None or any(m.kernel is not kernel for mods in projections for m in mods):
            return None
        attn0, cfg = layers[0].self_attn, config
        hq, hkv, d = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        all_norms = [n for layer in layers for n in vars(layer.norms()).values() if n is not None]
        all_norms.append(final_norm)
        for layer in layers:
            a = layer.self_attn
            if a.q_norm is not None and a.k_norm is not None:
                all_norms += [a.q_norm, a.k_norm]
                want_q, want_k = (hq * d, hkv * d) if a.full_qk_norm else (d, d)
                if a.q_norm.weight.shape != (want_q,) or a.k_norm.weight.shape != (want_k,):
                    return None
                assert a.q_norm.eps == a.k_norm.eps  # both built from rms_norm_eps (layers.py's Attention)
            elif (a.q_norm is None) != (a.k_norm is None):
                return None
            if a.sinks is not None and (a.sinks.dtype != torch.float32 or not a.sinks.is_contiguous()):
                return None
        if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in all_norms):
            return None
        k0 = kv_caches[0][0]
        shape = k0.shape
        if k0.dtype not in CACHE_DTYPE_CODES:
            return None
        # KV layer groups (server/core/kv_groups.py): each layer's caches are its group's size
        group_shapes: dict[int, torch.Size] = {}
        for layer, kv in zip(layers, kv_caches, strict=True):
            g = layer.self_attn.kv_group
            if g not in (0, 1) or group_shapes.setdefault(g, kv[0].shape) != kv[0].shape:
                return None
            if any(c.dtype != k0.dtype or c.shape != kv[0].shape or not _cache_layout_ok(c) for c in kv):
                return None
        shape = group_shapes.get(0, shape)
        descriptors: list[KiQWeight] = []
        kept_weights: list[BlockQuantWeight] = []
        kept_norms: list[Tensor] = []
        rotary_dims: dict[int, int] = {}
        structs = (_Layer * len(layers))()
        for i, (layer, (kc, vc), linears, rope, moe, n_attn) in enumerate(
            zip(layers, kv_caches, projections, rope_indices, moes, attn_counts, strict=True)
        ):
            # attention's 2 or 4, then the dense MLP's or the shared expert's gate_up and down (or none)
            attn_linears = linears[:n_attn]
            split = len(attn_linears) == 4  # separate q, k, v
            qkv, o = attn_linears[0], attn_linears[-1]
            kv_projs = attn_linears[1:3] if split else []
            want = [
                (qkv, hidden, (hq if split else hq + 2 * hkv) * d),
                *((m, hidden, hkv * d) for m in kv_projs),
                (o, hq * d, hidden),
            ]
            mlp_inter = inter if moe is None else int(moe.shared_inter)
            if len(linears) > len(attn_linears):
                want += [(linears[-2], hidden, 2 * mlp_inter), (linears[-1], mlp_inter, hidden)]
            if any((m.in_features, m.out_features) != (k, n) for m, k, n in want):
                return None
            spec, attn = layer.spec, layer.self_attn
            if (spec.rope is None) != (rope < 0):
                raise ValueError(f"layer {i}: rope index {rope} for rope {spec.rope}")
            if (
                spec.rope is not None
                and rotary_dims.setdefault(rope, spec.rope.rotary_dim) != spec.rope.rotary_dim
            ):
                raise ValueError(f"layer {i}: rope table {rope} has another width")
            weights = [m.weight_q for m in linears]
            kept_weights.extend(weights)  # the descriptors point into their tensors
            descs = [weight_descriptor(w, m.gemm_dtype) for w, m in zip(weights, linears, strict=True)]
            descriptors.extend(descs)
            norms = layer.norms()
            q_norm, qk_eps = _norm_field(attn.q_norm, kept_norms)
            k_norm, _ = _norm_field(attn.k_norm, kept_norms)
            k_desc, v_desc = (descs[1], descs[2]) if split else (None, None)
            o_desc = descs[len(attn_linears) - 1]
            # an MoE layer's gate_up / down fields are never read (its `moe` record serves the MLP, with
            # the shared expert's projections, if any)
            gate_up_desc, down_desc = (o_desc, o_desc) if moe is not None else (descs[-2], descs[-1])
            if moe is not None and len(linears) > len(attn_linears):
                moe.shared_gate_up = ctypes.addressof(descs[-2])
                moe.shared_down = ctypes.addressof(descs[-1])
            gate_up_bias, down_bias = (
                (None, None) if moe is not None else (_bias(linears[-2]), _bias(linears[-1]))
            )
            structs[i] = _Layer(
                ctypes.addressof(descs[0]),
                _bias(qkv),
                None if k_desc is None else ctypes.addressof(k_desc),
                _bias(kv_projs[0]) if split else None,
                None if v_desc is None else ctypes.addressof(v_desc),
                _bias(kv_projs[1]) if split else None,
                ctypes.addressof(o_desc),
                _bias(o),
                ctypes.addressof(gate_up_desc),
                gate_up_bias,
                ctypes.addressof(down_desc),
                down_bias,
                *(
                    field
                    for pair in zip(
                        *(
                            _norm_field(n, kept_norms)
                            for n in (norms.attn_in, norms.attn_out, norms.mlp_in, norms.mlp_out)
                        ),
                        strict=True,
                    )
                    for field in pair
                ),
                kc.data_ptr(),
                vc.data_ptr(),
                _QK_NORMS[spec.qk_norm] if attn.q_norm is not None else 0,
                q_norm,
                k_norm,
                qk_eps,
                rope,
                0 if spec.rope is None else spec.rope.rotary_dim,
                attn.scale,
                attn.sliding_window or 0,
                None if attn.sinks is None else attn.sinks.data_ptr(),
                spec.residual_multiplier,
                _ACTIVATIONS[spec.activation],
                spec.attn_softcap or 0.0,
                attn.kv_group,
                None if moe is None else ctypes.addressof(moe),
            )
        final_w, final_eps = _norm_field(final_norm, kept_norms)
        entry = decode_entry(kernel)  # int8-activation entry or qlinear (cpu_qgemv_q8.py)
        model_struct = _Model(
            ctypes.addressof(structs),
            len(layers),
            final_w,
            final_eps,
            hidden,
            inter,
            hq,
            hkv,
            d,
            shape[1],
            entry.address,
            _fn_address(backend.decode_kernel.lib.kubeinfer_paged_decode_capped),
            _fn_address(backend.decode_kernel.lib.kubeinfer_kv_store),
            CACHE_DTYPE_CODES[k0.dtype],
            _moe_entry(kept_moe),
        )
        num_tables = max(rope_indices) + 1
        if sorted(rotary_dims) != list(range(num_tables)):
            raise ValueError(f"rope_indices {rope_indices} leave a table unused")
        return DecodeGraph(
            ops=ops,
            model_struct=model_struct,
            cache_shape=shape,
            group1_cache_shape=group_shapes.get(1),
            dims=(hidden, inter, hq, hkv, d),
            rotary_dims=tuple(rotary_dims[i] for i in range(num_tables)),
            projections=projections,
            descriptors=descriptors,
            entry=entry,
            moes=moes,
            moe_blocks=[m if isinstance(m, SparseMoeBlock) else None for m in (lay.mlp for lay in layers)],
            _keep=(descriptors, kept_weights, kept_norms, structs, projections, kv_caches, layers, kept_moe),
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
        # quantized experts rebuild their call (descriptors with the new compute flag) on a gemm_dtype change
        for record, block in zip(self.moes, self.moe_blocks, strict=True):
            if record is None or block is None:
                continue
            bound = _experts_call(block)
            if bound is not None and record.experts != ctypes.addressof(bound[0].spec):
                self._keep = (*self._keep, *bound)
                record.experts = ctypes.addressof(bound[0].spec)
        self._synced_changes = BlockQuantLinear.gemm_dtype_changes

    @property
    def num_cache_slots(self) -> int:  # num_blocks * block_size
        return self.cache_shape[0] * self.cache_shape[1]

    def run(
        self,
        h: Tensor,  # [T, hidden] fp32 contiguous, the embeddings; becomes the residual stream
        tables: list[tuple[Tensor, Tensor]],  # per rotary table: cos, sin [T, R] fp32 contiguous
        meta: AttentionMetadata,  # T sequences of one new token each
    ) -> Tensor:  # [T, hidden] fp32: the final norm's output
        hidden, inter, hq, hkv, d = self.dims
        t = h.shape[0]
        if meta.num_seqs != t or meta.max_query_len != 1:
            raise ValueError("the decode graph runs pure-decode steps only (one new token per sequence)")
        if h.dtype != torch.float32 or tuple(h.shape) != (t, hidden) or not h.is_contiguous():
            raise ValueError(f"h must be a contiguous [T, {hidden}] fp32 tensor")
        if len(tables) < len(self.rotary_dims):
            raise ValueError(f"tables: {len(tables)} rotary tables, the layers use {len(self.rotary_dims)}")
        for r, pair in zip(self.rotary_dims, tables, strict=False):
            for name, table in zip(("cos", "sin"), pair, strict=True):
                if table.dtype != torch.float32 or tuple(table.shape) != (t, r) or not table.is_contiguous():
                    raise ValueError(f"{name} must be a contiguous [{t}, {r}] fp32 tensor")
        ctx = meta.context_lens
        if ctx.dtype != torch.int32 or not ctx.is_contiguous():
            raise ValueError("context_lens must be a contiguous int32 tensor")
        seqs = torch.arange(t, dtype=torch.int64)
        slots, block_tables = _checked_indices(meta, self.cache_shape, seqs)
        # windowed layers of KV group 1 read their own slots and tables (layers.py's Attention.kv_group)
        g1_shape = self.group1_cache_shape
        if g1_shape is not None and not meta.kv_groups:
            raise ValueError("the graph's layers read two KV groups, the metadata has one")
        slots_g1, tables_g1 = (
            (slots, block_tables) if g1_shape is None else _checked_indices(meta.group(1), g1_shape, seqs)
        )
        self.sync_compute()
        self.entry.restore()
        n = len(self.rotary_dims)
        cos_ptrs = (_ptr * max(n, 1))(*(tables[i][0].data_ptr() for i in range(n)))
        sin_ptrs = (_ptr * max(n, 1))(*(tables[i][1].data_ptr() for i in range(n)))
        out = torch.empty(t, hidden)
        moe = next((r for r in self.moes if r is not None), None)
        e, k = (moe.num_experts, moe.top_k) if moe is not None else (0, 0)
        routing_scratch = torch.empty(t, e + k)  # router logits [T, E], expert weights [T, top_k]
        expert_ids = torch.empty(t, k, dtype=torch.int64)
        # gate_up and act serve the dense MLPs and the shared experts (S may exceed I: Qwen2-MoE's)
        mlp = max([inter, *(int(r.shared_inter) for r in self.moes if r is not None)])
        shared = hidden if any(r is not None and r.shared_gate_up for r in self.moes) else 0
        widths = (hidden, (hq + 2 * hkv) * d, hq * d, 2 * mlp, mlp, hidden, shared)
        scratch = torch.empty(t, sum(widths))
        # x, qkv, attn, gate_up, act, delta, shared_out: consecutive [T, width] fp32 blocks of one allocation
        base, step_ptrs, position = scratch.data_ptr(), [], 0
        for width in widths:
            step_ptrs.append(base + 4 * position * t)
            position += width
        x, qkv, attn, gate_up, act, delta, shared_out = step_ptrs
        step = _Step(
            h.data_ptr(),
            out.data_ptr(),
            t,
            ctypes.addressof(cos_ptrs),
            ctypes.addressof(sin_ptrs),
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            ctx.data_ptr(),
            seqs.data_ptr(),
            x,
            qkv,
            attn,
            gate_up,
            act,
            delta,
            torch.get_num_threads(),
            slots_g1.data_ptr(),
            tables_g1.data_ptr(),
            tables_g1.shape[1],
            routing_scratch.data_ptr() if moe is not None else None,
            expert_ids.data_ptr() if moe is not None else None,
            routing_scratch.data_ptr() + 4 * t * e if moe is not None else None,
            shared_out if shared else None,
        )
        rc = self.ops.lib.kubeinfer_decode_forward(ctypes.byref(self.model_struct), ctypes.byref(step))
        if rc != 0:
            raise RuntimeError(f"decode graph returned {rc} (the hundreds say which op of a layer failed)")
        return out


def _checked_indices(
    meta: AttentionMetadata, cache_shape: torch.Size, seqs: Tensor
) -> tuple[Tensor, Tensor]:  # slot_mapping [T] int64, block_tables [T, max_blocks] int32
    """One KV group's slots and block tables, checked against its cache's [num_blocks, block_size, ...]."""
    slots, block_tables, t = meta.slot_mapping, meta.block_tables, seqs.shape[0]
    if slots.dtype != torch.int64 or tuple(slots.shape) != (t,) or not slots.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous [T] int64 tensor")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or not block_tables.is_contiguous():
        raise ValueError("block_tables must be a contiguous [T, max_blocks] int32 tensor")
    if t and (int(slots.min()) < 0 or int(slots.max()) >= cache_shape[0] * cache_shape[1]):
        raise ValueError("slot_mapping: slot out of range of the cache")
    check_decode_indices(t, cache_shape, block_tables, meta.context_lens, seqs, seqs)
    return slots, block_tables


def cache_pointers(kv_caches: list[tuple[Tensor, Tensor]]) -> tuple[int, ...]:
    """What a recorded graph must still find: a cache reallocated means a new recording."""
    return tuple(c.data_ptr() for kv in kv_caches for c in kv)
