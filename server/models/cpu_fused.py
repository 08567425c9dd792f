"""The compiled fused elementwise ops of a decoder layer (csrc/cpu_fused.cpp), fp32 on CPU (the gated
activations also bf16), via ctypes: every layer kind of the layer contract (layer_spec.py).

A one-token decode step of a small model spends more time dispatching torch ops than computing them: one
RMSNorm is ~8 ops (~50 us) over 576 values, and a layer runs ~30 such ops around its 4 matmuls. These
launchers replace the chains with one call each; `torch_*` are the plain-torch references they are tested
against (and what the model runs when the library cannot be built or the tensors are not fp32 on CPU).
Built once per source, flags and CPU like the other kernels (server/native.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from server.config import default_cache_dir
from server.native import KernelBuildError, NativeSource, load_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_fused.cpp"
# 6: kubeinfer_add_rms_norm_mixed; 7: residual_norm, gelu_tanh_mul, partial rotary; 8: softcap_paged_decode
# and the decode graph layer record's attn_softcap; 9: the layer record's MoE MLP (KiDecodeMoe),
# kubeinfer_moe_route; 10: softcap_paged_decode gone, the graph's attention pointer is the attention
# library's kubeinfer_paged_decode_capped (window, sinks and soft-cap); 11: KiDecodeMoe's shared expert
# and the step's shared_out; 12: the bf16 stream's add_rms_norm, residual_norm, rotary and head_rms_norm; argmax_rows;
# 13: the K/V store's signature (Hkv, D, block_size: int8 caches)
ABI_VERSION = 13
# -ffast-math: vectorized exp (libmvec) in silu and reassociated sums; compile step only (see
# server/attention/cpu_kernel.py for why not at link time). -mprefer-vector-width=512: GCC's tuning for
# AVX-512 CPUs keeps loops at 256 bits (libmvec's 8-wide expf); 512-bit loops cut a 16-user prefill step
# by ~4% on a 2-core Xeon with AMX (466-477 against 485-501 ms); no effect where -march has no AVX-512.
NATIVE = NativeSource(
    "cpu_fused",
    SOURCE,
    ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17"),
    abi_version=ABI_VERSION,
)


def torch_add_rms_norm(
    x: Tensor,  # [T, H] fp32, updated in place to x + delta when delta is given
    delta: Tensor | None,  # [T, H] fp32
    weight: Tensor,  # [H] fp32
    eps: float,
) -> Tensor:  # [T, H] fp32
    if delta is not None:
        x.add_(delta)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def torch_add_rms_norm_bf16(
    x: Tensor,  # [T, H] bf16, updated in place to the rounded x + delta when delta is given
    delta: Tensor | None,  # [T, H] bf16
    weight: Tensor,  # [H] fp32
    eps: float,
) -> Tensor:  # [T, H] bf16
    """The bf16 stream's add + norm: fp32 arithmetic on the widened stream, each written value rounded once."""
    if delta is not None:
        x.copy_((x.float() + delta.float()).bfloat16())
    return torch_add_rms_norm(x.float(), None, weight, eps).bfloat16()


def torch_rotary(
    x: Tensor,  # [T, heads, D] fp32 or bf16, rotated in place
    cos: Tensor,  # [T, R] fp32, R <= D: the leading R channels of each head rotate
    sin: Tensor,  # [T, R] fp32, first half negated (RotaryEmbedding's tables)
) -> None:
    r = cos.shape[-1]
    rot = x[..., :r]
    wide = rot.float()  # bf16 x: in fp32, rounded once by the copy
    rot.copy_(torch.addcmul(wide * cos[:, None], wide.roll(r // 2, dims=-1), sin[:, None]))


def torch_residual_norm(
    x: Tensor,  # [T, H] fp32 or bf16, the residual stream, updated in place
    delta: Tensor | None,  # [T, H] x's dtype, normalized in place where post is given
    post: tuple[Tensor, float] | None,  # ([H] fp32 weight, eps) of the sub-block's post-norm
    mult: float,
    next_norm: tuple[Tensor, float] | None,  # ([H] fp32 weight, eps) of the next norm
) -> Tensor | None:  # [T, H] x's dtype next_norm(x), or None without a next norm
    if delta is not None:
        if post is not None:
            delta.copy_(torch_add_rms_norm(delta.float(), None, *post))
        x.copy_(x.float() + delta.float() * mult)  # bf16: in fp32, rounded once
    return None if next_norm is None else torch_add_rms_norm(x.float(), None, *next_norm).to(x.dtype)


def torch_head_rms_norm(
    x: Tensor,  # [T, heads, D] fp32 or bf16, normalized in place (bf16: in fp32, rounded once)
    weight: Tensor,  # [D] fp32
    eps: float,
) -> None:
    xf = x.float()
    x.copy_(weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)))


def torch_silu_mul(gate_up: Tensor) -> Tensor:  # gate_up: [T, 2I] fp32 or bf16 -> [T, I] same dtype
    gate, up = gate_up.float().chunk(2, dim=-1)  # bf16: computed in fp32, rounded once (as the kernel)
    return (F.silu(gate) * up).to(gate_up.dtype)


def torch_gelu_tanh_mul(gate_up: Tensor) -> Tensor:  # gate_up: [T, 2I] fp32 or bf16 -> [T, I] same dtype
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def _check_rows(name: str, t: Tensor, cols: int, dtype: torch.dtype = torch.float32) -> None:
    # A wrong pointer or stride would read stray memory: metadata checks only, cheap enough per layer.
    if t.dtype != dtype or t.device.type != "cpu":
        want = "fp32" if dtype == torch.float32 else "bf16"
        raise TypeError(f"{name}: must be a CPU {want} tensor, got {t.dtype} on {t.device}")
    if t.dim() != 2 or t.shape[1] != cols or (cols > 1 and t.stride(1) != 1):
        raise ValueError(f"{name}: must be [T, {cols}] with unit stride along a row, got {tuple(t.shape)}")


def _output(
    out: Tensor | None, rows: int, cols: int, dtype: torch.dtype = torch.float32
) -> Tensor:  # [rows, cols] in dtype, checked if given
    if out is None:
        return torch.empty(rows, cols, dtype=dtype)
    _check_rows("out", out, cols, dtype)
    if out.shape[0] != rows:  # the kernel writes `rows` rows: fewer would be written past the end
        raise ValueError(f"out: {out.shape[0]} rows, the input has {rows}")
    return out


@dataclass(frozen=True)
class FusedOps:
    """The loaded library; every launcher checks dtypes, shapes and strides before passing pointers."""

    lib: ctypes.CDLL
    path: Path

    def add_rms_norm(
        self,
        x: Tensor,  # [T, H] fp32, unit stride along H; becomes x + delta (the residual stream)
        delta: Tensor | None,  # [T, H] fp32 or bf16 (a bf16 GEMM's own result), unit stride along H
        weight: Tensor,  # [H] fp32 contiguous
        eps: float,
        out: Tensor | None = None,  # [T, H] in out_dtype
        out_dtype: torch.dtype = torch.float32,  # or torch.bfloat16: the operand of a bf16 GEMM
    ) -> Tensor:  # [T, H] out_dtype: weight * x / sqrt(mean(x^2) + eps), after the add
        """A bf16 delta is widened exactly and a bf16 out rounded to nearest even: bit-identical to
        `add_rms_norm(x, delta.float(), ...).bfloat16()` (tests/engine/test_cpu_fused_ops.py), without
        the fp32 copies around a bf16 GEMM. A bf16 x (a bf16 model's stream) takes a bf16 delta and gives a
        bf16 out: the fp32 kernel's values on the widened stream, rounded once (within one ulp of
        `torch_add_rms_norm_bf16`, whose sums run in another order)."""
        t, h = x.shape[0], x.shape[-1]
        if x.dtype == torch.bfloat16:
            return self._add_rms_norm_bf16(x, delta, weight, eps, out, out_dtype)
        _check_rows("x", x, h)
        delta_bf16 = delta is not None and delta.dtype == torch.bfloat16
        if delta is not None:
            _check_rows("delta", delta, h, torch.bfloat16 if delta_bf16 else torch.float32)
            if delta.shape[0] != t:
                raise ValueError(f"delta: {delta.shape[0]} rows, x has {t}")
        if weight.dtype != torch.float32 or tuple(weight.shape) != (h,) or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [{h}] fp32 tensor")
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"out_dtype must be fp32 or bf16, got {out_dtype}")
        out = _output(out, t, h, out_dtype)
        # One entry for every dtype pair: with fp32 delta and out it runs the fp32 kernel's own row loop
        rc = self.lib.kubeinfer_add_rms_norm_mixed(
            x.data_ptr(),
            x.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            int(delta_bf16),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            int(out_dtype == torch.bfloat16),
            t,
            h,
            float(eps),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"add_rms_norm kernel returned {rc}")
        return out

    def _add_rms_norm_bf16(
        self,
        x: Tensor,  # [T, H] bf16, unit stride along H; becomes the rounded x + delta
        delta: Tensor | None,  # [T, H] bf16, unit stride along H
        weight: Tensor,  # [H] fp32 contiguous
        eps: float,
        out: Tensor | None,  # [T, H] bf16
        out_dtype: torch.dtype,  # bf16: the stream's own dtype
    ) -> Tensor:  # [T, H] bf16
        t, h = x.shape[0], x.shape[-1]
        _check_rows("x", x, h, torch.bfloat16)
        if delta is not None:
            _check_rows("delta", delta, h, torch.bfloat16)
            if delta.shape[0] != t:
                raise ValueError(f"delta: {delta.shape[0]} rows, x has {t}")
        if weight.dtype != torch.float32 or tuple(weight.shape) != (h,) or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [{h}] fp32 tensor")
        if out_dtype != torch.bfloat16:
            raise TypeError(f"a bf16 stream's norm is bf16, got out_dtype {out_dtype}")
        out = _output(out, t, h, torch.bfloat16)
        # residual_norm's bf16 entry with no post-norm and mult 1: x = round(x + delta), out = its norm
        rc = self.lib.kubeinfer_residual_norm_bf16(
            x.data_ptr(),
            x.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            None,
            0.0,
            1.0,
            weight.data_ptr(),
            float(eps),
            out.data_ptr(),
            out.stride(0),
            t,
            h,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"add_rms_norm's bf16 kernel returned {rc}")
        return out

    def rotary(
        self,
        x: Tensor,  # [T, heads, D] fp32 or bf16, rotated in place; heads dense within a row (row stride free)
        cos: Tensor,  # [T, R] fp32 contiguous, R <= D even: the leading R channels of each head rotate
        sin: Tensor,  # [T, R] fp32 contiguous, first half negated
    ) -> None:
        """bf16 x: each value widened, rotated by the fp32 kernel's arithmetic, rounded once (within one ulp
        of `torch_rotary`)."""
        if x.dtype not in _STREAM_DTYPES or x.device.type != "cpu" or x.dim() != 3:
            raise TypeError(
                f"x must be a [T, heads, D] CPU fp32 or bf16 tensor, got {x.dtype} {tuple(x.shape)}"
            )
        t, heads, d = x.shape
        if x.stride(2) != 1 or (heads > 1 and x.stride(1) != d):
            raise ValueError(f"x: each row's heads must be dense, got strides {x.stride()}")
        r = cos.shape[-1] if cos.dim() == 2 else -1
        if r <= 0 or r % 2 or r > d:
            raise ValueError(f"cos must be [T, R] with an even R <= {d}, got {tuple(cos.shape)}")
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dtype != torch.float32 or tuple(table.shape) != (t, r) or not table.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [{t}, {r}] fp32 tensor")
        fn = self.lib.kubeinfer_rotary if x.dtype == torch.float32 else self.lib.kubeinfer_rotary_bf16
        rc = fn(
            x.data_ptr(), x.stride(0), t, heads, d, r, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"rotary kernel returned {rc}")

    def residual_norm(
        self,
        x: Tensor,  # [T, H] fp32 or bf16, unit stride along H: the residual stream, updated in place
        delta: Tensor
        | None,  # [T, H] x's dtype, unit stride along H; normalized in place where post is given
        post: tuple[Tensor, float] | None,  # ([H] fp32 contiguous weight, eps): the sub-block's post-norm
        mult: float,  # the residual multiplier (Granite), 1.0 for none
        next_norm: tuple[Tensor, float] | None,  # ([H] fp32 contiguous weight, eps) of the next norm
    ) -> Tensor | None:  # [T, H] x's dtype: next_norm(x), or None without a next norm
        """One residual step of any norm placement (layer_spec.NormPlacement): x += mult * post(delta),
        then the next norm. Norm weights are as applied (Gemma's 1 + w already added: RMSNorm.applied_weight).
        With no post and mult 1 it runs add_rms_norm's own row loop: bit-identical to `add_rms_norm`. A bf16
        x (a bf16 model's stream) takes a bf16 delta and gives a bf16 out: each value widened, the fp32
        row functions, each written value (the post-normed delta, x, out) rounded once."""
        t, h = x.shape[0], x.shape[-1]
        stream = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        _check_rows("x", x, h, stream)
        if delta is not None:
            _check_rows("delta", delta, h, stream)
            if delta.shape[0] != t:
                raise ValueError(f"delta: {delta.shape[0]} rows, x has {t}")
        for name, pair in (("post", post), ("next_norm", next_norm)):
            if pair is not None:
                w = pair[0]
                if w.dtype != torch.float32 or tuple(w.shape) != (h,) or not w.is_contiguous():
                    raise ValueError(f"{name} weight must be a contiguous [{h}] fp32 tensor")
        out = None if next_norm is None else torch.empty(t, h, dtype=stream)
        fn = (
            self.lib.kubeinfer_residual_norm
            if stream == torch.float32
            else self.lib.kubeinfer_residual_norm_bf16
        )
        rc = fn(
            x.data_ptr(),
            x.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            None if post is None else post[0].data_ptr(),
            0.0 if post is None else float(post[1]),
            float(mult),
            None if next_norm is None else next_norm[0].data_ptr(),
            0.0 if next_norm is None else float(next_norm[1]),
            None if out is None else out.data_ptr(),
            h,
            t,
            h,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"residual_norm kernel returned {rc}")
        return out

    def head_rms_norm(
        self,
        x: Tensor,  # [T, heads, D] fp32 or bf16, normalized in place; heads dense within a row (row stride free)
        weight: Tensor,  # [D] fp32 contiguous, shared by all heads
        eps: float,
    ) -> None:
        """Each head: weight * x / sqrt(mean(x^2) + eps) over D (Qwen3's q_norm / k_norm); bf16 x: in fp32,
        rounded once."""
        if x.dtype not in _STREAM_DTYPES or x.device.type != "cpu" or x.dim() != 3:
            raise TypeError(
                f"x must be a [T, heads, D] CPU fp32 or bf16 tensor, got {x.dtype} {tuple(x.shape)}"
            )
        t, heads, d = x.shape
        if x.stride(2) != 1 or (heads > 1 and x.stride(1) != d):
            raise ValueError(f"x: each row's heads must be dense, got strides {x.stride()}")
        if weight.dtype != torch.float32 or tuple(weight.shape) != (d,) or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [{d}] fp32 tensor")
        fn = (
            self.lib.kubeinfer_head_rms_norm
            if x.dtype == torch.float32
            else self.lib.kubeinfer_head_rms_norm_bf16
        )
        rc = fn(
            x.data_ptr(), x.stride(0), t, heads, d, weight.data_ptr(), float(eps), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"head_rms_norm kernel returned {rc}")

    def silu_mul(
        self,
        gate_up: Tensor,  # [T, 2I] fp32 or bf16, gate then up, unit stride along a row
        out: Tensor | None = None,  # [T, I] in gate_up's dtype
    ) -> Tensor:  # [T, I] in gate_up's dtype
        """silu(gate) * up. bf16 in, bf16 out: each value widened, the fp32 kernel's arithmetic, rounded to
        nearest even; bit-identical to `silu_mul(gate_up.float()).bfloat16()` (tests/engine/test_cpu_fused_ops.py)."""
        return self.act_mul(gate_up, "silu", out)

    @property
    def argmax_vectorized(self) -> bool:
        """Whether `argmax_rows` runs its AVX-512 lanes (the build's CPU has AVX-512F): elsewhere its plain
        loop is slower than torch's argmax and the sampler keeps torch's."""
        return bool(self.lib.kubeinfer_argmax_vectorized())

    def argmax_rows(self, x: Tensor) -> Tensor:  # x: [S, V] fp32, unit stride along V -> [S] int64
        """torch.argmax(x, -1) bit for bit (the first of equal maxima; a NaN above every number, the first
        NaN), in one pass of integer compares: with AVX-512, 0.17 / 0.60 ms at 16 / 64 rows of Llama-3's
        128,256-token vocabulary where torch's took 0.6-1.2 / 2.3 ms (Zen 5, 2 threads)."""
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"x must be [S, V] with V > 0, got {tuple(x.shape)}")
        _check_rows("x", x, x.shape[1])
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = self.lib.kubeinfer_argmax_rows(
            x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"argmax_rows kernel returned {rc}")
        return out

    def act_mul(
        self,
        gate_up: Tensor,  # [T, 2I] fp32 or bf16, gate then up, unit stride along a row
        activation: str,  # layer_spec.Activation: "silu" or "gelu_tanh"
        out: Tensor | None = None,  # [T, I] in gate_up's dtype
    ) -> Tensor:  # [T, I] in gate_up's dtype
        """act(gate) * up for the layer's activation (SwiGLU or GeGLU with the tanh GELU); bf16 as silu_mul.
        Raises ValueError for another activation."""
        t, two_i = gate_up.shape[0], gate_up.shape[-1]
        if two_i % 2:
            raise ValueError(f"gate_up: last dim {two_i} is not even")
        if activation not in _ACT_FNS:
            raise ValueError(f"activation must be one of {sorted(_ACT_FNS)}, got {activation!r}")
        inter = two_i // 2
        fp32_fn, bf16_fn = _ACT_FNS[activation]
        if gate_up.dtype == torch.bfloat16:
            _check_rows("gate_up", gate_up, two_i, torch.bfloat16)
            out = _output(out, t, inter, torch.bfloat16)
            fn = getattr(self.lib, bf16_fn)
        else:
            _check_rows("gate_up", gate_up, two_i)
            out = _output(out, t, inter)
            fn = getattr(self.lib, fp32_fn)
        rc = fn(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            t,
            inter,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"{activation} kernel returned {rc}")
        return out


_STREAM_DTYPES = (torch.float32, torch.bfloat16)  # the rotary's and head norm's in-place dtypes

# layer_spec.Activation -> the library's fp32 and bf16 entry points
_ACT_FNS = {
    "silu": ("kubeinfer_silu_mul", "kubeinfer_silu_mul_bf16"),
    "gelu_tanh": ("kubeinfer_gelu_tanh_mul", "kubeinfer_gelu_tanh_mul_bf16"),
}


@functools.cache
def load_fused_ops(cache_dir: Path | None = None) -> FusedOps:
    """Builds (or finds under `cache_dir`/kernels) and loads the library; raises KernelBuildError."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.kubeinfer_add_rms_norm_mixed.argtypes = [
        ptr,
        i64,
        ptr,
        i64,
        i32,
        ptr,
        ptr,
        i64,
        i32,
        i64,
        i64,
        f32,
        i32,
    ]
    lib.kubeinfer_rotary.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i32]
    lib.kubeinfer_residual_norm.argtypes = [
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        f32,
        f32,
        ptr,
        f32,
        ptr,
        i64,
        i64,
        i64,
        i32,
    ]
    for name in (
        "kubeinfer_silu_mul",
        "kubeinfer_silu_mul_bf16",
        "kubeinfer_gelu_tanh_mul",
        "kubeinfer_gelu_tanh_mul_bf16",
    ):
        getattr(lib, name).argtypes = [ptr, i64, ptr, i64, i64, i64, i32]
    lib.kubeinfer_head_rms_norm.argtypes = [ptr, i64, i64, i64, i64, ptr, f32, i32]
    lib.kubeinfer_head_rms_norm_bf16.argtypes = [ptr, i64, i64, i64, i64, ptr, f32, i32]
    lib.kubeinfer_rotary_bf16.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i32]
    lib.kubeinfer_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, i32]
    lib.kubeinfer_residual_norm_bf16.argtypes = lib.kubeinfer_residual_norm.argtypes
    lib.kubeinfer_argmax_vectorized.argtypes = []
    lib.kubeinfer_decode_forward.argtypes = [ptr, ptr]
    lib.kubeinfer_moe_route.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i32]
    for fn in (
        lib.kubeinfer_add_rms_norm_mixed,
        lib.kubeinfer_rotary,
        lib.kubeinfer_residual_norm,
        lib.kubeinfer_silu_mul,
        lib.kubeinfer_silu_mul_bf16,
        lib.kubeinfer_gelu_tanh_mul,
        lib.kubeinfer_gelu_tanh_mul_bf16,
        lib.kubeinfer_head_rms_norm,
        lib.kubeinfer_head_rms_norm_bf16,
        lib.kubeinfer_rotary_bf16,
        lib.kubeinfer_argmax_rows,
        lib.kubeinfer_residual_norm_bf16,
        lib.kubeinfer_argmax_vectorized,
        lib.kubeinfer_decode_forward,
        lib.kubeinfer_moe_route,
    ):
        fn.restype = i32
    return FusedOps(lib, path)


def try_load_fused_ops(cache_dir: Path | None = None) -> FusedOps | None:
    """The library, or None (logged once, with why) where it cannot be built: the torch ops serve."""
    try:
        return load_fused_ops(cache_dir)
    except (KernelBuildError, OSError) as e:
        log.warning("fused CPU ops unavailable, the decoder layers run plain torch ops: %s", e)
        return None
