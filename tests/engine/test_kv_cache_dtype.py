"""--kv-cache-dtype: the decode kernel over bf16/fp16 caches (every x86-64 build level), the K/V write's
rounding, the torch backend's reads of a narrower cache, how `auto` resolves and what is refused."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_decode_ref, paged_attention_ref
from paged_batch import ATTN_TOL, make_attention_metadata, make_paged_batch

from server.attention import int8_kv
from server.attention.backend import make_attention_backend
from server.attention.cpu_kernel import NATIVE, DecodeKernel, bind_decode_kernel, load_decode_kernel
from server.attention.kv_cache_dtype import resolve_kv_cache_dtype
from server.attention.torch_backend import TorchAttentionBackend
from server.cli import build_parser, config_from_args
from server.config import CacheConfig, EngineConfig, ModelConfig, default_cache_dir
from server.engine import LLMEngine
from server.native import (
    VARIANTS,
    build,
    compiler,
    cpu_flags,
    effective_compile_flags,
    usable_cpu_features,
    variant_flags,
)

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CACHE_IDS = ["fp32", "bf16", "fp16"]
# fp32 q/out over a rounded cache against the fp32 reference over the same rounded values: the only
# differences are the order of fp32 sums, as for an fp32 cache.
FP32_TOL = ATTN_TOL[torch.float32]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DecodeKernel]:
    """The kernel built at every x86-64 level this CPU runs (the images prebuild each): AVX-512, AVX2 +
    F16C, and the portable conversions of v2 and the baseline."""
    folder = tmp_path_factory.mktemp("levels")
    flags = cpu_flags()
    kernels = {}
    for variant in VARIANTS:
        if not variant.cpu_flags <= flags:
            continue
        path = folder / f"{variant.march}.so"
        build(NATIVE, compiler(), path, variant_flags(NATIVE, variant))
        kernels[variant.march] = bind_decode_kernel(ctypes.CDLL(str(path)), path)
    assert "x86-64" in kernels
    # The build `load_decode_kernel` makes here (-march=native less what the OS does not enable), and the
    # same build with its bf16 K pass turned off (what KUBEINFER_CPU_DISABLE=avx512_bf16 or a CPU without
    # AVX512-BF16 runs). Every AVX-512 build carries that pass (a target attribute), the images' v4 level too.
    native = effective_compile_flags(NATIVE, default_cache_dir())
    for name in ("native", "native-bf16-off"):
        path = folder / f"{name}.so"
        build(NATIVE, compiler(), path, native)
        kernels[name] = bind_decode_kernel(ctypes.CDLL(str(path)), path)
    kernels["native-bf16-off"].lib.kubeinfer_paged_decode_set_bf16(0)
    assert not kernels["native-bf16-off"].lib.kubeinfer_paged_decode_bf16_enabled()
    usable = usable_cpu_features()
    if usable.avx512_bf16 and usable.avx512bw:
        assert kernels["native"].bf16 and kernels.get("x86-64-v4", kernels["native"]).bf16
    return kernels


def _levels() -> list[str]:
    return [v.march for v in VARIANTS] + ["native", "native-bf16-off"]


def test_each_level_runs_its_own_decode_passes(builds: dict[str, DecodeKernel]) -> None:
    """The AVX-512 build runs the 16-lane register passes, the AVX2 (x86-64-v3) build the 8-lane ones, the
    older levels the generic loops: each level's build is the only place its passes run, so the parametrized
    test below covers all three wherever the CPU runs the levels."""
    want = {"x86-64-v4": "avx512", "x86-64-v3": "avx2", "x86-64-v2": "generic", "x86-64": "generic"}
    assert {level: builds[level].isa for level in want if level in builds} == {
        level: isa for level, isa in want.items() if level in builds
    }
    usable = usable_cpu_features()
    native = "avx512" if usable.avx512f else "avx2" if usable.avx2 and usable.fma else "generic"
    assert builds["native"].isa == native


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
# head_dim 72: the AVX2 passes (8-lane) but not the AVX-512 ones (16-lane); gqa 9: past the register V pass
@pytest.mark.parametrize(
    ("gqa", "block_size", "head_dim"), [(1, 16, 64), (3, 16, 64), (4, 8, 64), (9, 16, 64), (2, 32, 72)]
)
def test_kernel_over_a_narrow_cache_matches_the_reference(
    builds: dict[str, DecodeKernel],
    level: str,
    cache_dtype: torch.dtype,
    gqa: int,
    block_size: int,
    head_dim: int,
) -> None:
    if level not in builds:
        pytest.skip(f"this CPU cannot run {level}")
    kernel = builds[level]
    # one token, one and two blocks, ragged multi-block, and long ones cut into parts
    ctx = [1, block_size, 2 * block_size, 3 * block_size + 5, 300, 1500]
    batch = make_paged_batch(
        [1] * len(ctx),
        ctx,
        num_heads=3 * gqa,
        num_kv_heads=3,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=torch.device("cpu"),
        q_scale=3.0,
    )
    kc, vc = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    out = torch.full_like(batch.q, float("nan"))
    seqs = rows = torch.arange(len(ctx))
    kernel(out, batch.q, kc, vc, batch.block_tables, batch.context_lens, seqs, rows, 0.125)
    ref = paged_attention_decode_ref(
        batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, 0.125
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=FP32_TOL[0], rtol=FP32_TOL[1])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_bf16_queries_over_another_cache_dtype(cache_dtype: torch.dtype) -> None:
    """A bf16 model with --kv-cache-dtype float32/float16: q and out stay bf16, the sums fp32."""
    batch = make_paged_batch(
        [1] * 3, [5, 40, 333], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    q = batch.q.bfloat16()
    kc, vc = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    out = torch.empty_like(q)
    seqs = torch.arange(3)
    load_decode_kernel()(out, q, kc, vc, batch.block_tables, batch.context_lens, seqs, seqs, 0.125)
    ref = paged_attention_decode_ref(
        q.float(), kc.float(), vc.float(), batch.block_tables, batch.context_lens, 0.125
    )
    atol, rtol = ATTN_TOL[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def _awkward_values(n: int) -> torch.Tensor:
    """Random values plus what rounding gets wrong: ties at both dtypes' last bit, fp16 overflow and
    subnormals, bf16 carries into the exponent, signed zeros and infinities."""
    special = [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-5, 6.1e-5, 1e-7, 3e-8, 2.98e-8]
    special += [float("inf"), float("-inf"), 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8]
    special += [float.fromhex("0x1.fffffep+0"), 2**-24, 1.5 * 2**-24, 2**-25, 2**-14 - 2**-25]
    base = torch.cat([torch.tensor(special), -torch.tensor(special)])
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32).view(torch.float32)
    bits = bits[torch.isfinite(bits)]
    return torch.cat([base, torch.randn(n) * 100, bits])


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_kv_store_rounds_like_torch(
    builds: dict[str, DecodeKernel], level: str, cache_dtype: torch.dtype
) -> None:
    """The decode graph's write (kubeinfer_kv_store) gives the bits torch's `.to()` gives: the Python
    path writes with it, and the graph must stay bit-identical to that path."""
    if level not in builds:
        pytest.skip(f"this CPU cannot run {level}")
    values = _awkward_values(4096)
    hkv, d = 2, 64
    t = values.numel() // (hkv * d)
    k = values[: t * hkv * d].view(t, hkv, d)
    v = k.flip(0)
    # k and v as views into one fused [T, 2 * Hkv * D] row, as in the graph's qkv buffer
    fused = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    kf, vf = fused[:, : hkv * d].view(t, hkv, d), fused[:, hkv * d :].view(t, hkv, d)
    block_size = 8
    num_blocks = -(-t // block_size) + 2
    slots = torch.randperm(num_blocks * block_size)[:t]
    kc = torch.zeros(num_blocks, block_size, hkv, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    builds[level].store_kv(kc, vc, slots, kf, vf)
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(-1, hkv, d)[slots] = k.to(cache_dtype)
    want_v.view(-1, hkv, d)[slots] = v.to(cache_dtype)
    int_type = torch.int32 if cache_dtype == torch.float32 else torch.int16
    assert torch.equal(kc.view(int_type), want_k.view(int_type))
    assert torch.equal(vc.view(int_type), want_v.view(int_type))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpu", "torch"])
@pytest.mark.parametrize(
    ("query_lens", "prefix_lens"),
    [([1, 12, 20, 1, 3], [30, 0, 9, 64, 16]), ([1, 8, 8, 1, 8, 5, 5], [20, 0, 0, 33, 0, 16, 16])],
    ids=["mixed", "grouped"],  # grouped: chunks of one shape attend in one SDPA call
)
def test_backend_rounds_on_write_and_attends_over_the_rounded_cache(
    cache_dtype: torch.dtype, use_kernel: bool, query_lens: list[int], prefix_lens: list[int]
) -> None:
    """fp32 q/k/v over a narrow cache, decode rows between prompt chunks with cached prefixes: the cache
    holds k.to(cache_dtype), the output is fp32 and matches the fp32 reference over the rounded cache,
    for the chunk without a cached prefix too (it attends over its K/V rounded alike). Decode rows attend
    in fp32; prompt chunks too, except where the compiled prefill kernel serves them (a bf16 cache with
    usable AVX512-BF16: bf16 products, so bf16's tolerance)."""
    block_size, hq, hkv, d = 16, 9, 3, 64
    meta = make_attention_metadata(query_lens, prefix_lens, block_size, torch.device("cpu"))
    n = sum(query_lens)
    shape = (int(meta.block_tables.max()) + 2, block_size, hkv, d)
    kc, vc = torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    backend = TorchAttentionBackend(block_size, load_decode_kernel() if use_kernel else None)
    out = backend.forward(q, k, v, kc, vc, meta, 0.125)
    assert out.dtype == torch.float32
    assert torch.equal(kc.view(-1, hkv, d)[meta.slot_mapping], k.to(cache_dtype))
    assert torch.equal(vc.view(-1, hkv, d)[meta.slot_mapping], v.to(cache_dtype))
    ref = paged_attention_ref(
        q, kc.float(), vc.float(), meta.block_tables, meta.context_lens, meta.query_start_loc, 0.125
    )
    kernel = backend.decode_kernel
    bf16_chunks = kernel is not None and kernel.prefill_supported(q.dtype, cache_dtype, d)
    decode = torch.tensor(
        [s for s, n in zip(meta.query_start_loc.tolist(), query_lens, strict=False) if n == 1]
    )
    torch.testing.assert_close(out[decode], ref[decode], atol=1e-4, rtol=1e-4)
    atol, rtol = ATTN_TOL[torch.bfloat16] if bf16_chunks else (1e-4, 1e-4)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_auto_follows_the_compute_dtype() -> None:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    # a GGUF served quantized: fp32 activations, --dtype auto resolving to bf16 on this CPU or not
    assert resolve_kv_cache_dtype("auto", f32, bf16, "cpu") == bf16
    assert resolve_kv_cache_dtype("auto", f32, f32, "cpu") == f32
    assert resolve_kv_cache_dtype("auto", bf16, bf16, "cpu") == bf16
    assert resolve_kv_cache_dtype("auto", f16, f16, "cuda") == f16
    assert resolve_kv_cache_dtype("float16", f32, bf16, "cpu") == f16
    assert resolve_kv_cache_dtype("float32", bf16, bf16, "cpu") == f32
    assert resolve_kv_cache_dtype("bfloat16", bf16, bf16, "cuda") == bf16
    with pytest.raises(ValueError, match="--kv-cache-dtype float32: the CUDA"):
        resolve_kv_cache_dtype("float32", bf16, bf16, "cuda")
    assert resolve_kv_cache_dtype("int8", f32, bf16, "cpu") == torch.int8
    with pytest.raises(
        ValueError, match="--kv-cache-dtype int8: the int8 cache is read by the CPU kernels only"
    ):
        resolve_kv_cache_dtype("int8", f16, f16, "cuda")


def test_cache_config_refuses_fp8_and_unknown_names() -> None:
    assert CacheConfig(cache_dtype="float16").cache_dtype == "float16"
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3: fp8 KV caches are not supported"):
        CacheConfig(cache_dtype="fp8_e4m3")
    assert CacheConfig(cache_dtype="int8").cache_dtype == "int8"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        CacheConfig(cache_dtype="int4")


def test_cli_flag_and_env_var() -> None:
    assert config_from_args(build_parser({}).parse_args([])).engine.cache.cache_dtype == "auto"
    args = build_parser({"KUBEINFER_KV_CACHE_DTYPE": "float16"}).parse_args([])
    assert config_from_args(args).engine.cache.cache_dtype == "float16"
    args = build_parser({}).parse_args(["--kv-cache-dtype", "bfloat16"])
    assert config_from_args(args).engine.cache.cache_dtype == "bfloat16"
    args = build_parser({"KUBEINFER_KV_CACHE_DTYPE": "int8"}).parse_args([])
    assert config_from_args(args).engine.cache.cache_dtype == "int8"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--kv-cache-dtype", "fp8"], {}, "argument --kv-cache-dtype: fp8 KV caches (fp8) are not supported"),
        (["--kv-cache-dtype", "half"], {}, "argument --kv-cache-dtype: invalid choice 'half'"),
        ([], {"KUBEINFER_KV_CACHE_DTYPE": "fp8_e5m2"}, "KUBEINFER_KV_CACHE_DTYPE='fp8_e5m2': fp8 KV caches"),
    ],
    ids=["fp8-flag", "unknown-flag", "fp8-env"],
)
def test_refused_values_are_startup_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_base_env(), **env},
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("KUBEINFER_")}


# ---- int8 caches (server/attention/int8_kv.py) ----------------------------------------------------------


def _int8_cache(x: torch.Tensor) -> torch.Tensor:  # x: [num_blocks, block_size, Hkv, D] float
    """x quantized into an int8 cache by the reference (int8_kv.quantize)."""
    cache = int8_kv.allocate(*x.shape)
    q, scale = int8_kv.quantize(x)
    cache.copy_(q)
    int8_kv.scales(cache).copy_(scale)
    return cache


def _dequantized(cache: torch.Tensor) -> torch.Tensor:
    return int8_kv.dequantize(cache, int8_kv.scales(cache), torch.float32)


def test_int8_layout_scales_and_blocks() -> None:
    """The values view and the scales view share one buffer per block; blocks gather with their scales."""
    cache = int8_kv.allocate(5, 4, 2, 64)
    assert int8_kv.is_int8_cache(cache) and not cache.is_contiguous()
    assert not int8_kv.is_int8_cache(torch.zeros(5, 4, 2, 64, dtype=torch.int8))
    x = torch.randn(5, 4, 2, 64)
    x[1, 2, 0, :32] = 0.0  # a group of zeros: scale 0
    q, scale = int8_kv.quantize(x)
    cache.copy_(q)
    int8_kv.scales(cache).copy_(scale)
    # the buffer holds each block's values, then its rows' scales: nothing overlaps
    assert torch.equal(cache, q) and torch.equal(int8_kv.scales(cache), scale)
    assert scale.shape == (5, 4, 2, 2) and scale[1, 2, 0, 0] == 0
    # each value within half a step of its group's scale
    err = (int8_kv.dequantize(q, scale, torch.float32) - x).abs().unflatten(-1, (2, 32))
    assert (err <= scale[..., None] / 2 * 1.0001 + 1e-30).all()
    blocks = torch.tensor([3, 0, 3])
    got = int8_kv.gather_blocks(cache, blocks, torch.float32)
    assert torch.equal(got, int8_kv.dequantize(q[blocks], scale[blocks], torch.float32))
    assert int8_kv.block_bytes(4, 2, 64) == 4 * 2 * (64 + 2 * 4)
    one = int8_kv.allocate(1, 4, 2, 64)  # one block: its stride still steps over the scales
    assert int8_kv.is_int8_cache(one) and int8_kv.scales(one).shape == (1, 4, 2, 2)
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        int8_kv.allocate(1, 16, 1, 80)


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize(
    ("gqa", "block_size", "head_dim"), [(1, 16, 64), (3, 16, 96), (4, 8, 128), (9, 16, 64), (2, 32, 256)]
)
def test_kernel_over_an_int8_cache_matches_the_reference(
    builds: dict[str, DecodeKernel], level: str, gqa: int, block_size: int, head_dim: int
) -> None:
    """fp32 q over an int8 cache against the fp32 reference over the dequantized cache: the kernel
    dequantizes each value as it loads it (one fp32 product, the reference's), so only the order of the
    fp32 sums differs."""
    if level not in builds:
        pytest.skip(f"this CPU cannot run {level}")
    ctx = [1, block_size, 2 * block_size, 3 * block_size + 5, 300, 1500]
    batch = make_paged_batch(
        [1] * len(ctx), ctx, num_heads=3 * gqa, num_kv_heads=3, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, device=torch.device("cpu"), q_scale=3.0,
    )  # fmt: skip
    kc, vc = _int8_cache(batch.k_cache), _int8_cache(batch.v_cache)
    out = torch.full_like(batch.q, float("nan"))
    seqs = torch.arange(len(ctx))
    builds[level](out, batch.q, kc, vc, batch.block_tables, batch.context_lens, seqs, seqs, 0.125)
    ref = paged_attention_decode_ref(
        batch.q, _dequantized(kc), _dequantized(vc), batch.block_tables, batch.context_lens, 0.125
    )
    torch.testing.assert_close(out, ref, atol=FP32_TOL[0], rtol=FP32_TOL[1])
    # and the quantization's own error stays small against the unquantized cache (outputs of ~1; sharp
    # softmaxes: q_scale 3): measured mean ~0.003, largest ~0.07
    err = (out - paged_attention_decode_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125
    )).abs()  # fmt: skip
    assert err.mean() < 0.01 and err.max() < 0.25, (err.mean(), err.max())


@pytest.mark.parametrize("level", _levels())
def test_int8_store_matches_the_reference_bit_for_bit(builds: dict[str, DecodeKernel], level: str) -> None:
    """kubeinfer_kv_store quantizes each group of 32 as int8_kv.quantize does: the Python path and the
    decode graph write through it, and the prompt path's reference must agree with what decode reads."""
    if level not in builds:
        pytest.skip(f"this CPU cannot run {level}")
    hkv, d, block_size, t = 2, 64, 8, 40
    k = torch.randn(t, hkv, d) * torch.logspace(-30, 30, t)[:, None, None]
    k[3] = 0.0  # rows of zeros: scale 0
    k[4, 1, 32:] = 0.0  # a group of zeros beside a group of values
    k[5, 0, 7] = -1e4  # one outlier: the rest of its group rounds to few levels
    k[6] = torch.tensor([2.5, -2.5, 0.5, 127.0]).repeat(hkv, d // 4)  # ties at x * 127 / 127
    v = k.flip(0)
    fused = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], dim=1)  # views into one qkv-like row
    kf, vf = fused[:, : hkv * d].view(t, hkv, d), fused[:, hkv * d :].view(t, hkv, d)
    num_blocks = -(-t // block_size) + 2
    slots = torch.randperm(num_blocks * block_size)[:t]
    kc, vc = (
        int8_kv.allocate(num_blocks, block_size, hkv, d),
        int8_kv.allocate(num_blocks, block_size, hkv, d),
    )
    builds[level].store_kv(kc, vc, slots, kf, vf)
    blocks, offsets = slots // block_size, slots % block_size
    for cache, x in ((kc, k), (vc, v)):
        q, scale = int8_kv.quantize(x)
        assert torch.equal(cache[blocks, offsets], q)
        assert torch.equal(int8_kv.scales(cache)[blocks, offsets].view(torch.int32), scale.view(torch.int32))
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slots] = False
        assert not cache.reshape(-1, hkv, d)[untouched].any()


@pytest.mark.parametrize(
    ("query_lens", "prefix_lens"),
    [([1, 12, 20, 1, 3], [30, 0, 9, 64, 16]), ([1, 8, 8, 1, 8, 5, 5], [20, 0, 0, 33, 0, 16, 16])],
    ids=["mixed", "grouped"],
)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_over_an_int8_cache(
    query_lens: list[int], prefix_lens: list[int], q_dtype: torch.dtype
) -> None:
    """Decode rows between prompt chunks with cached prefixes over an int8 cache: the cache holds
    quantize(k), every row (the chunk without a cached prefix too) matches the reference over the
    dequantized cache, in bf16's tolerance where the chunks go to bf16 SDPA (AMX) or q is bf16."""
    block_size, hq, hkv, d = 16, 9, 3, 64
    meta = make_attention_metadata(query_lens, prefix_lens, block_size, torch.device("cpu"))
    n = sum(query_lens)
    shape = (int(meta.block_tables.max()) + 2, block_size, hkv, d)
    kc, vc = _int8_cache(torch.randn(shape)), _int8_cache(torch.randn(shape))
    q, k, v = (torch.randn(n, h, d).to(q_dtype) for h in (hq, hkv, hkv))
    kernel = load_decode_kernel()
    backend = TorchAttentionBackend(block_size, kernel)
    out = backend.forward(q, k, v, kc, vc, meta, 0.125)
    assert out.dtype == q_dtype
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    assert torch.equal(kc[blocks, offsets], int8_kv.quantize(k)[0])
    assert torch.equal(vc[blocks, offsets], int8_kv.quantize(v)[0])
    ref = paged_attention_ref(
        q.float(), _dequantized(kc), _dequantized(vc), meta.block_tables, meta.context_lens,
        meta.query_start_loc, 0.125,
    )  # fmt: skip
    decode = torch.tensor(
        [s for s, m in zip(meta.query_start_loc.tolist(), query_lens, strict=False) if m == 1]
    )
    narrow = kernel.amx_bf16 or q_dtype == torch.bfloat16
    atol, rtol = ATTN_TOL[torch.bfloat16] if narrow else (1e-4, 1e-4)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    if q_dtype == torch.float32:
        torch.testing.assert_close(out[decode], ref[decode], atol=1e-4, rtol=1e-4)


def test_int8_cache_refusals_are_startup_errors(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    narrow = str(tiny_model_factory("llama"))  # head_dim 16
    with pytest.raises(ValueError, match=r"--kv-cache-dtype int8 needs head_dim divisible by 32.*is 16"):
        LLMEngine(EngineConfig(model=ModelConfig(model=narrow), cache=CacheConfig(cache_dtype="int8")))
    folder = str(tiny_model_factory("llama", heads=2, kv_heads=1))  # head_dim 32
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 needs the compiled CPU attention kernel"):
        LLMEngine(
            EngineConfig(
                model=ModelConfig(model=folder),
                cache=CacheConfig(cache_dtype="int8"),
                attention_backend="torch",
            )
        )
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=folder), cache=CacheConfig(cache_dtype="int8")))
    assert engine.info.kv_cache_dtype == "int8" and int8_kv.is_int8_cache(engine.runner.kv_caches[0][0])
    assert make_attention_backend("cpu", 16).name == "cpu"
