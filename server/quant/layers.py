"""Drop-in quantized replacements for nn.Linear: forward(x: [T, in]) -> [T, out], like the Linear they replace.

Two kinds:
- checkpoint modules (AwqCheckpointLinear, GptqCheckpointLinear, Fp8CheckpointLinear) exist only between
  `prepare_for_checkpoint` and `finalize`: their state_dict keys are the checkpoint's tensor names, so
  `load_state_dict(assign=True)` fills them;
- runtime modules (Int4Linear, Int8Linear, Fp8Linear, BnbLinear), which the model runs with. The memory
  they hold stays quantized; no module keeps a dequantized copy of its weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.quant.formats import AWQ_PACK_ORDER, Int4Weights, pack_int4_cols

FP8_E4M3_MAX = 448.0
# Candidate scales per octave that fp8_channel_scales tries (8 measured as good as 16 on the embedded
# model's KL at half the load time).
FP8_SCALE_STEPS = 8


def _nbytes(tensors: Sequence[Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class QuantLinear(nn.Module):
    """Base of the runtime modules; `weight_nbytes` counts everything the layer holds for its weight."""

    method = "none"

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features

    def weight_nbytes(self) -> int:
        return _nbytes(list(self.buffers()) + list(self.parameters()))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}"


def _register_bias(module: nn.Module, bias: Tensor | None) -> None:
    if bias is None:
        module.register_parameter("bias", None)
    else:
        module.bias = nn.Parameter(bias, requires_grad=False)


# ------------------------------------------------------------------ checkpoint modules


class AwqCheckpointLinear(nn.Module):
    """Holds an AWQ GEMM layer's tensors exactly as stored: qweight, qzeros, scales (+ bias)."""

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, device: Any) -> None:
        super().__init__()
        if in_features % group_size or out_features % 8:
            raise ValueError(
                f"AWQ layer {in_features}x{out_features}: in_features must divide by group_size={group_size} "
                "and out_features by 8"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.empty(in_features, out_features // 8, dtype=torch.int32, device=device)
        )
        self.register_buffer(
            "qzeros", torch.empty(groups, out_features // 8, dtype=torch.int32, device=device)
        )
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("an AWQ checkpoint layer runs only after quant.finalize() repacked it")


class GptqCheckpointLinear(nn.Module):
    """Holds a GPTQ layer's tensors exactly as stored: qweight, qzeros, scales, g_idx (+ bias)."""

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    g_idx: Tensor
    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, device: Any) -> None:
        super().__init__()
        if in_features % group_size or in_features % 8 or out_features % 8:
            raise ValueError(
                f"GPTQ layer {in_features}x{out_features}: in_features must divide by group_size={group_size} "
                "and by 8, out_features by 8"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.empty(in_features // 8, out_features, dtype=torch.int32, device=device)
        )
        self.register_buffer(
            "qzeros", torch.empty(groups, out_features // 8, dtype=torch.int32, device=device)
        )
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("a GPTQ checkpoint layer runs only after quant.finalize() repacked it")


class Fp8CheckpointLinear(nn.Module):
    """An fp8 e4m3 checkpoint layer: weight [N, K] float8_e4m3fn and weight_scale (per tensor or per channel)."""

    weight: Tensor
    weight_scale: Tensor
    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool, device: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # Checkpoints store the scale per tensor ([] or [1]) or per channel ([N] or [N, 1]): one layout here.
        key = prefix + "weight_scale"
        scale = state_dict.get(key)
        if isinstance(scale, Tensor):
            scale = scale.float().reshape(-1, 1)
            if scale.shape[0] == 1:
                scale = scale.expand(self.out_features, 1).clone()
            state_dict[key] = scale
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("an fp8 checkpoint layer runs only after quant.finalize()")


# ------------------------------------------------------------------ int4


def _cpu_int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


CPU_INT4_GROUP_SIZES = (32, 64, 128, 256)


class Int4Linear(QuantLinear):
    """4-bit group-quantized Linear (AWQ, GPTQ, on-the-fly int4), repacked for the device at construction.

    Backends:
    - "cpu": torch's int4 CPU kernel. It computes w = (q - 8) * scale + zero with a float zero, so an
      asymmetric integer zero point z becomes zero = (8 - z) * scale exactly (also z = 16 from GPTQ v1).
      It runs in bf16 (fast; fp32 activations are 10x slower), so activations go through bf16.
      Act-order (GPTQ desc_act) with equal-sized groups becomes a permutation of the input channels.
    - "triton": the AWQ-layout Triton kernel (kernels.int4_gemm), for CUDA.
    - "dequant": keeps the AWQ-packed tensors and dequantizes per forward (any device, any g_idx).
    """

    method = "int4"
    bias: Tensor | None
    packed: Tensor  # cpu: [N, K/2] uint8 in the kernel's tile order
    scales_and_zeros: Tensor  # cpu: [K/G, N, 2] bf16
    perm: Tensor | None  # cpu act-order: [K] int64 input-channel order
    qweight: Tensor  # triton/dequant: [K, N/8] int32, AWQ order
    qzeros: Tensor | None  # triton/dequant: [K/G, N/8] int32, AWQ order
    zeros_unpacked: Tensor | None  # dequant with a zero of 16: [K/G, N] uint8
    scales: Tensor  # triton/dequant: [K/G, N] fp16
    g_idx: Tensor | None  # triton/dequant: [K] int32, None = k // G

    def __init__(self, w: Int4Weights, bias: Tensor | None, backend: str = "auto") -> None:
        super().__init__(w.in_features, w.out_features)
        self.group_size = w.group_size
        device = w.intweight.device
        if backend == "auto":
            backend = default_int4_backend(w, device)
        self.backend = backend
        _register_bias(self, bias)
        if backend == "cpu":
            perm = None
            if not w.has_trivial_g_idx():
                perm = torch.argsort(w.g_idx.long(), stable=True)
            intweight = w.intweight if perm is None else w.intweight.index_select(0, perm)
            # [N, K] int32 -> [N, K/2] uint8 in the kernel's own tile order.
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(intweight.t().contiguous(), 1)
            scales = w.scales.float()
            zero_f = (8 - w.zeros).float() * scales
            self.register_buffer("packed", packed)
            self.register_buffer(
                "scales_and_zeros", torch.stack([scales, zero_f], dim=-1).to(torch.bfloat16).contiguous()
            )  # [K/G, N, 2]
            self.register_buffer("perm", perm)
        elif backend in ("triton", "dequant"):
            if backend == "triton" and int(w.zeros.max()) > 15:
                raise ValueError("the Triton int4 kernel needs zero points in 0..15")
            zeros = w.zeros
            if backend == "dequant":
                # Stored unpacked only if it does not fit 4 bits (GPTQ v1's wrapped zero of 0 reads 16).
                zeros_fit = int(zeros.max()) <= 15
            else:
                zeros_fit = True
            self.register_buffer("qweight", pack_int4_cols(w.intweight, AWQ_PACK_ORDER))  # [K, N/8]
            if zeros_fit:
                self.register_buffer("qzeros", pack_int4_cols(zeros, AWQ_PACK_ORDER))  # [K/G, N/8]
                self.register_buffer("zeros_unpacked", None)
            else:
                self.register_buffer("qzeros", None)
                self.register_buffer("zeros_unpacked", zeros.to(torch.uint8))  # [K/G, N]
            self.register_buffer("scales", w.scales.to(torch.float16).contiguous())  # [K/G, N]
            self.register_buffer(
                "g_idx", None if w.has_trivial_g_idx() else w.g_idx.to(torch.int32).contiguous()
            )
            self.perm = None
        else:
            raise ValueError(f"unknown int4 backend {backend!r}; expected auto, cpu, triton or dequant")

    def _dequantized(self, dtype: torch.dtype) -> Tensor:  # [K, N]
        from server.quant.formats import unpack_int4_cols

        q = unpack_int4_cols(self.qweight, AWQ_PACK_ORDER)
        if self.qzeros is not None:
            z = unpack_int4_cols(self.qzeros, AWQ_PACK_ORDER)
        else:
            assert self.zeros_unpacked is not None
            z = self.zeros_unpacked.to(torch.int32)
        if self.g_idx is None:
            g = torch.arange(self.in_features, device=q.device) // self.group_size
        else:
            g = self.g_idx.long()
        return ((q - z[g]).to(dtype) * self.scales.to(dtype)[g]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, K] -> [T, N]
        if self.backend == "cpu":
            xb = x.to(torch.bfloat16)
            if self.perm is not None:
                xb = xb.index_select(-1, self.perm)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, self.packed, self.group_size, self.scales_and_zeros
            )
            y = y.to(x.dtype)
        elif self.backend == "triton":
            from kubeinfer_kernels.gemm_int4 import int4_gemm

            assert self.qzeros is not None
            y = int4_gemm(x.contiguous(), self.qweight, self.qzeros, self.scales, self.group_size, self.g_idx)
        else:
            y = x @ self._dequantized(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def default_int4_backend(w: Int4Weights, device: torch.device) -> str:
    if device.type == "cpu":
        counts = torch.bincount(w.g_idx.long(), minlength=w.in_features // w.group_size)
        equal_groups = bool((counts == w.group_size).all())
        if _cpu_int4_available() and w.group_size in CPU_INT4_GROUP_SIZES and equal_groups:
            return "cpu"
        return "dequant"
    if device.type == "cuda" and int(w.zeros.max()) <= 15:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "dequant"
        return "triton"
    return "dequant"


# ------------------------------------------------------------------ int8


class Int8Linear(QuantLinear):
    """Weight-only int8, one symmetric scale per output channel: w = q * scale[n]."""

    method = "int8"
    bias: Tensor | None
    qweight: Tensor  # [N, K] int8
    scale: Tensor | None  # cpu: [N] bf16
    scale_f32: Tensor | None  # other devices: [N] fp32

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        # qweight: [N, K] int8; scale: [N] float
        super().__init__(qweight.shape[1], qweight.shape[0])
        self.register_buffer("qweight", qweight.contiguous())
        # bf16 because torch's int8 CPU kernel wants scales in the activation dtype and is fast only in bf16.
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("scale_f32", None)
        if qweight.device.type != "cpu":
            self.scale_f32 = scale.float()
            self.scale = None
        _register_bias(self, bias)

    @classmethod
    def quantize(cls, weight: Tensor, bias: Tensor | None) -> Int8Linear:  # weight: [N, K]
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
        # Round the scale through bf16 first so the integers are chosen for the scale actually used.
        scale = scale.to(torch.bfloat16).float()
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, bias)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, K] -> [T, N]
        if self.scale is not None:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).to(x.dtype)
        else:
            assert self.scale_f32 is not None
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale_f32.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


# ------------------------------------------------------------------ fp8


def fp8_channel_scales(
    weight: Tensor, steps: int = FP8_SCALE_STEPS, rows: int = 1024, sample: int = 256
) -> Tensor:
    """Per-output-channel e4m3 scales [N] fp32 for weight [N, K] (any float dtype): of `steps`
    candidates spaced evenly (in log) over one octave above amax / 448, the one whose round trip has the
    least squared error on every (K // sample)-th column of the row, kept only where that is no worse
    than amax / 448 on the whole row.

    Why search: e4m3 keeps 3 mantissa bits, so a weight's rounding error depends on where it falls in
    its binade, and a row's error on how the scale aligns its values with the binades; amax / 448 is one
    arbitrary alignment. Every candidate is at least as large, so none saturates (amax maps to <= 448).
    Candidates beyond one octave only repeat the alignments one binade up. The column sample keeps the
    search at about 2 + steps * sample / K round trips of the weight: loading the 135M embedded model in
    fp8 took 7.7 s against int8's 1.7 s on one core of a loaded machine (a whole-row search of 16 took
    ~30 s, for a KL 3% lower). On the embedded SmolLM2 it cut the weights' relative
    error from 2.63% to 2.50% and the mean KL divergence from the fp32 model over the held-out text from
    0.0140 to 0.0110 nats/token (docs/quantization.md, "fp8: where the error comes from")."""
    out = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    stride = max(1, weight.shape[1] // sample)
    for start in range(0, weight.shape[0], rows):  # bounds the temporaries of a large matrix
        w = weight[start : start + rows].float()  # [n, K]
        base = (w.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp(min=1e-12)  # [n, 1]
        part = w[:, ::stride] / base  # [n, K / stride], |values| <= 448
        best = torch.ones_like(base)  # [n, 1], the chosen multiple of base
        best_err = torch.full_like(base, float("inf"))
        for i in range(steps):
            a = 2.0 ** (i / steps)
            err = (part.div(a).to(torch.float8_e4m3fn).float().mul_(a).sub_(part)).square_().sum(1, True)
            better = err < best_err
            best = torch.where(better, a, best)
            best_err = torch.where(better, err, best_err)
        if stride > 1:  # the sample chose; the whole row decides against amax / 448
            full = w / base
            chosen = full.div(best).to(torch.float8_e4m3fn).float().mul_(best).sub_(full)
            plain = full.to(torch.float8_e4m3fn).float().sub_(full)
            keep = chosen.square_().sum(1, True) <= plain.square_().sum(1, True)
            best = torch.where(keep, best, torch.ones_like(best))
        out[start : start + rows] = (base * best).squeeze(1)
    return out


class Fp8Linear(QuantLinear):
    """Weight-only fp8 e4m3, one scale per output channel: w = fp8_weight * scale[n]; on-the-fly
    quantization picks each channel's scale by fp8_channel_scales.

    On CUDA with sm_89+ the Triton kernel converts in registers; on CPU decode batches (up to
    cpu_fp8.MAX_ROWS rows) take the compiled kernel, which widens each code in registers (a byte a weight
    read, fp32 sums); larger batches and other devices convert the weight per forward.
    """

    method = "fp8"
    bias: Tensor | None
    weight: Tensor  # [N, K] float8_e4m3fn
    scale: Tensor  # [N] fp32

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None, cpu_kernel: bool = True) -> None:
        # weight: [N, K] float8 (e4m3fn; another float8 takes torch's conversion); scale: [N] fp32;
        # cpu_kernel False: torch's conversion on CPU too
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().reshape(-1).contiguous())
        _register_bias(self, bias)
        dev = weight.device
        self.use_triton = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
        # decided once here: a kernel that cannot be built is not asked again per forward
        self.cpu_kernel = False
        if (
            cpu_kernel
            and dev.type == "cpu"
            and self.weight.dtype == torch.float8_e4m3fn
            and self.out_features
        ):
            from server.quant.cpu_fp8 import check_codes, try_load_fp8_kernel

            check_codes(self.weight)
            self.cpu_kernel = try_load_fp8_kernel() is not None

    @classmethod
    def quantize(
        cls, weight: Tensor, bias: Tensor | None, cpu_kernel: bool = True
    ) -> Fp8Linear:  # weight: [N, K]
        w = weight.float()
        scale = fp8_channel_scales(w)
        q = (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return cls(q, scale, bias, cpu_kernel)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, K] -> [T, N]
        if self.use_triton:
            from kubeinfer_kernels.gemm_fp8 import fp8_gemm

            y = fp8_gemm(x.contiguous(), self.weight, self.scale)
        else:
            kernel_y = self._cpu_kernel_linear(x)
            y = (
                F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
                if kernel_y is None
                else kernel_y
            )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _cpu_kernel_linear(self, x: Tensor) -> Tensor | None:  # x: [..., K] -> [..., N], or None
        from server.quant.cpu_fp8 import MAX_ROWS, try_load_fp8_kernel

        rows = x.numel() // self.in_features if self.in_features else 0
        if not self.cpu_kernel or x.device.type != "cpu" or not 0 < rows <= MAX_ROWS:
            return None
        kernel = try_load_fp8_kernel()  # cached: the one __init__ found
        if kernel is None:
            return None
        x2 = x.reshape(rows, self.in_features).float().contiguous()
        y = kernel.linear(x2, self.weight, self.scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


# ------------------------------------------------------------------ bitsandbytes


class BnbLinear(QuantLinear):
    """bitsandbytes nf4 / fp4 (blockwise 4-bit, block 64, double-quantized statistics) or LLM.int8()."""

    def __init__(
        self, weight: Tensor, bias: Tensor | None, quant_type: str, compute_dtype: torch.dtype
    ) -> None:
        # weight: [N, K] float
        super().__init__(weight.shape[1], weight.shape[0])
        import bitsandbytes as bnb

        self.quant_type = quant_type
        self.method = f"bitsandbytes-{quant_type}"
        device = weight.device
        inner: nn.Module
        if quant_type in ("nf4", "fp4"):
            inner = bnb.nn.Linear4bit(
                self.in_features,
                self.out_features,
                bias=bias is not None,
                compute_dtype=compute_dtype,
                quant_type=quant_type,
                device="meta",
            )
            inner.weight = bnb.nn.Params4bit(
                weight.to(compute_dtype).cpu(), requires_grad=False, quant_type=quant_type
            )
        elif quant_type == "int8":
            inner = bnb.nn.Linear8bitLt(
                self.in_features,
                self.out_features,
                bias=bias is not None,
                has_fp16_weights=False,
                device="meta",
            )
            inner.weight = bnb.nn.Int8Params(
                weight.to(compute_dtype).cpu(), requires_grad=False, has_fp16_weights=False
            )
        else:
            raise ValueError(f"unknown bitsandbytes quant_type {quant_type!r}; expected nf4, fp4 or int8")
        if bias is not None:
            inner.bias = nn.Parameter(bias.to(compute_dtype).cpu(), requires_grad=False)
        # Moving the parameters to a real device is what makes bitsandbytes quantize them.
        self.inner = inner.to(device)

    def weight_nbytes(self) -> int:
        w = self.inner.weight
        total = _nbytes([w.data, self.inner.bias])
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            total += _nbytes([v for v in qs.as_dict(packed=True).values() if isinstance(v, Tensor)])
        scb = getattr(w, "SCB", None)
        if isinstance(scb, Tensor):
            total += _nbytes([scb])
        return total

    def forward(self, x: Tensor) -> Tensor:  # x: [T, K] -> [T, N]
        if self.quant_type == "int8":
            # LLM.int8() computes in fp16 anyway (and warns on every call when handed anything else).
            return self.inner(x.to(torch.float16)).to(x.dtype)
        return self.inner(x).to(x.dtype)
