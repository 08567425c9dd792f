"""The compiled CPU decode-attention kernel: against the torch reference, through the CPU backend, its
argument checks, and how it is built, cached and replaced by plain torch when it cannot be built."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_decode_ref, paged_attention_ref, store_kv_cache_ref
from paged_batch import ATTN_TOL, make_attention_metadata, make_paged_batch

from server.attention import make_attention_backend
from server.attention.cpu_kernel import DecodeKernel, KernelBuildError, load_decode_kernel
from server.attention.torch_backend import TorchAttentionBackend
from server.native import PROBE, library_path


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    return load_decode_kernel()


def _contexts(block_size: int) -> list[int]:
    # 1 token, exactly one and two blocks, ragged multi-block, and one long enough to span many blocks.
    return [1, block_size, 2 * block_size, 3 * block_size + 5, 45, 300]


def _identity(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [1, 3, 4, 8, 9])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_kernel_matches_reference(
    kernel: DecodeKernel, block_size: int, head_dim: int, gqa: int, dtype: torch.dtype
) -> None:
    ctx = _contexts(block_size)
    batch = make_paged_batch(
        [1] * len(ctx),
        ctx,
        num_heads=2 * gqa,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    scale = head_dim**-0.5
    out = torch.full_like(batch.q, float("nan"))
    seqs, rows = _identity(len(ctx))
    kernel(
        out, batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, seqs, rows, scale
    )
    ref = paged_attention_decode_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale
    )
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_contexts_split_into_parts_match_reference(kernel: DecodeKernel, dtype: torch.dtype) -> None:
    """Few sequences with long contexts: each context is cut into slices attended in parallel and
    merged; the merge must give what one pass over the whole context gives."""
    ctx = [3001, 700]
    batch = make_paged_batch(
        [1, 1],
        ctx,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=torch.device("cpu"),
        q_scale=4.0,  # peaky softmax: a wrong rescaling of a slice shows up
    )
    out = torch.empty_like(batch.q)
    kernel(
        out,
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        *_identity(2),
        0.125,
    )
    ref = paged_attention_decode_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125
    )
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_kernel_writes_only_its_rows_and_reads_strided_queries(kernel: DecodeKernel) -> None:
    """q as a view into a fused qkv projection (rows strided), decode sequences scattered among other
    rows of the batch: the kernel writes exactly rows[i] of out and reads the right table row."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    ctx = [40, 7, 100]
    batch = make_paged_batch(
        [1] * 3,
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    num_tokens = 9
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not q.is_contiguous()
    rows = torch.tensor([7, 0, 4], dtype=torch.int64)
    seqs = torch.tensor([2, 0, 1], dtype=torch.int64)
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"))
    kernel(out, q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, seqs, rows, 0.125)

    expected_q = q.index_select(0, rows).contiguous()
    ref = paged_attention_decode_ref(
        expected_q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables.index_select(0, seqs),
        batch.context_lens.index_select(0, seqs),
        0.125,
    )
    torch.testing.assert_close(out.index_select(0, rows), ref, atol=2e-5, rtol=2e-5)
    untouched = [r for r in range(num_tokens) if r not in rows.tolist()]
    assert out[untouched].isnan().all()


@pytest.mark.parametrize(
    ("query_lens", "prefix_lens"),
    [
        ([1, 1, 1, 1], [0, 16, 40, 200]),
        ([1, 12, 20, 1, 3], [30, 0, 9, 64, 16]),  # decode rows between prefill chunks and a prefix hit
        # chunks of one shape share an SDPA call: three without a prefix (not back to back in T), two
        # over the same cached length, one of their length over another
        ([1, 8, 8, 1, 8, 5, 5, 5], [20, 0, 0, 33, 0, 16, 16, 40]),
        ([7, 7, 7], [0, 0, 0]),  # the whole batch one group: SDPA's output is returned as is
        ([6, 6], [10, 10]),
    ],
    ids=["decode", "mixed", "grouped", "one-group", "one-group-prefix"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_backend_matches_torch_backend_and_reference(
    kernel: DecodeKernel, query_lens: list[int], prefix_lens: list[int], dtype: torch.dtype
) -> None:
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    cpu = torch.device("cpu")
    meta = make_attention_metadata(query_lens, prefix_lens, block_size, cpu)
    num_tokens = sum(query_lens)
    cache_shape = (int(meta.block_tables.max()) + 2, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(cache_shape).to(dtype), torch.randn(cache_shape).to(dtype)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    scale = head_dim**-0.5

    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("cpu", "torch", "ref")}
    with_kernel = TorchAttentionBackend(block_size, kernel)
    assert with_kernel.name == "cpu"
    out = with_kernel.forward(q, k, v, *caches["cpu"], meta, scale)
    out_torch = TorchAttentionBackend(block_size).forward(q, k, v, *caches["torch"], meta, scale)
    store_kv_cache_ref(k, v, *caches["ref"], meta.slot_mapping)
    ref = paged_attention_ref(
        q, *caches["ref"], meta.block_tables, meta.context_lens, meta.query_start_loc, scale
    )

    assert torch.equal(caches["cpu"][0], caches["ref"][0]) and torch.equal(caches["cpu"][1], caches["ref"][1])
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out.float(), out_torch.float(), atol=atol, rtol=rtol)


def test_prefill_chunks_of_one_shape_share_an_sdpa_call(
    kernel: DecodeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One [B, H, n, D] call per shape (n, context length) instead of one per chunk: B times fewer calls
    # into CPU SDPA, each with enough work to use its threads (docs/benchmarks.md, "CPU: the prefill step").
    import server.attention.torch_backend as tb

    calls: list[tuple[int, ...]] = []
    sdpa = tb.F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tb.F, "scaled_dot_product_attention", spy)
    block_size, hq, hkv, d = 16, 9, 3, 64
    query_lens, prefix_lens = [1, 8, 8, 1, 8, 5, 5, 5], [20, 0, 0, 33, 0, 16, 16, 40]
    meta = make_attention_metadata(query_lens, prefix_lens, block_size, torch.device("cpu"))
    n = sum(query_lens)
    shape = (int(meta.block_tables.max()) + 2, block_size, hkv, d)
    kc, vc = torch.randn(shape), torch.randn(shape)
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    TorchAttentionBackend(block_size, kernel).forward(q, k, v, kc, vc, meta, 0.125)
    assert sorted(calls) == [(1, hq, 5, d), (2, hq, 5, d), (3, hq, 8, d)]


def _valid_args() -> dict[str, torch.Tensor]:
    batch = make_paged_batch(
        [1, 1],
        [5, 20],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    seqs, rows = _identity(2)
    return {
        "out": torch.empty_like(batch.q),
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": batch.block_tables,
        "context_lens": batch.context_lens,
        "seqs": seqs,
        "rows": rows,
    }


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"q": lambda a: a["q"].half(), "out": lambda a: a["out"].half()}, TypeError, "float32 or bfloat16"),
        ({"k_cache": lambda a: a["k_cache"].bfloat16()}, TypeError, "k_cache, v_cache: dtypes"),
        ({"block_tables": lambda a: a["block_tables"].long()}, TypeError, "block_tables"),
        ({"k_cache": lambda a: a["k_cache"].transpose(0, 1)}, ValueError, "k_cache: must be contiguous"),
        ({"out": lambda a: a["out"][:1]}, ValueError, "q and out"),
        ({"seqs": lambda a: torch.tensor([0, 2])}, ValueError, "seqs: index out of range"),
        ({"rows": lambda a: torch.tensor([0, -1])}, ValueError, "rows: index out of range"),
        ({"context_lens": lambda a: torch.tensor([0, 20], dtype=torch.int32)}, ValueError, "context_lens"),
        (
            {"context_lens": lambda a: torch.tensor([5, 10_000], dtype=torch.int32)},
            ValueError,
            "context_lens",
        ),
        ({"block_tables": lambda a: a["block_tables"] + 1000}, ValueError, "block id out of range"),
        (
            {
                "q": lambda a: torch.zeros(2, 4, 576),
                "out": lambda a: torch.zeros(2, 4, 576),
                "k_cache": lambda a: torch.zeros(8, 8, 2, 576),
                "v_cache": lambda a: torch.zeros(8, 8, 2, 576),
            },
            ValueError,
            "head_dim 576",
        ),
    ],
    ids=[
        "fp16",
        "mixed-dtypes",
        "int64-tables",
        "strided-cache",
        "out-shape",
        "bad-seq",
        "negative-row",
        "empty-context",
        "context-past-table",
        "block-past-cache",
        "head-dim-too-large",
    ],
)
def test_kernel_rejects_bad_arguments(
    kernel: DecodeKernel,
    change: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]],
    error: type[Exception],
    match: str,
) -> None:
    """A wrong pointer or index would crash the whole server: every such call must raise instead."""
    args = _valid_args()
    args.update({name: make(args) for name, make in change.items()})
    with pytest.raises(error, match=match):
        kernel(**args, scale=0.125)


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache and no loaded kernel; the process-wide one is restored afterwards."""
    monkeypatch.setenv("KUBEINFER_CACHE_DIR", str(tmp_path))
    load_decode_kernel.cache_clear()
    yield tmp_path / "kernels"
    load_decode_kernel.cache_clear()


def test_kernel_is_built_once_and_then_loaded_from_the_cache(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_decode_kernel()
    assert first.path.parent == fresh_build and first.path.is_file()
    built_at = first.path.stat().st_mtime_ns
    # No build leftovers: the kernel and the CPU feature probe its flags were chosen by.
    assert sorted(p.name for p in fresh_build.iterdir()) == sorted(
        [first.path.name, library_path(PROBE, fresh_build.parent).name]
    )
    # A cached library needs no compiler: a rebuild would fail now.
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    load_decode_kernel.cache_clear()
    again = load_decode_kernel()
    assert again.path == first.path and again.path.stat().st_mtime_ns == built_at
    out = torch.empty(1, 2, 64)
    again(
        out,
        torch.ones(1, 2, 64),
        torch.zeros(1, 4, 1, 64),
        torch.full((1, 4, 1, 64), 3.0),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        *_identity(1),
        0.125,
    )
    torch.testing.assert_close(out, torch.full((1, 2, 64), 3.0))  # equal scores: the mean of equal values


def test_an_explicit_cache_dir_wins(fresh_build: Path, tmp_path: Path) -> None:
    """--cache-dir (ModelConfig.cache_dir) holds the kernel too, not only the converted weights."""
    backend = make_attention_backend("cpu", 16, "cpu", tmp_path / "elsewhere")
    assert isinstance(backend, TorchAttentionBackend) and backend.decode_kernel is not None
    assert backend.decode_kernel.path.parent == tmp_path / "elsewhere" / "kernels"
    assert not fresh_build.exists()


def test_compiler_errors_are_reported(
    fresh_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with pytest.raises(KernelBuildError, match="this compiler is broken"):
        load_decode_kernel()
    assert not any(p.suffix == ".so" for p in fresh_build.iterdir())
    monkeypatch.setenv("CXX", "no-such-compiler")
    load_decode_kernel.cache_clear()
    with pytest.raises(KernelBuildError, match="no-such-compiler"):
        load_decode_kernel()


def test_auto_falls_back_to_torch_without_a_compiler(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with caplog.at_level(logging.WARNING):
        backend = make_attention_backend("auto", 16, "cpu")
    assert backend.name == "torch"
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler"):
        make_attention_backend("cpu", 16, "cpu")


def test_backend_names() -> None:
    assert make_attention_backend("auto", 16, "cpu").name == "cpu"  # a compiler is installed here
    assert make_attention_backend("torch", 16, "cpu").name == "torch"
    with pytest.raises(ValueError, match="runs on CPU only"):
        make_attention_backend("cpu", 16, "cuda")
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention_backend("flash", 16, "cpu")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_kernel_shares_torchs_openmp_runtime(kernel: DecodeKernel) -> None:
    """Two OpenMP runtimes in one process would mean two thread pools fighting over the cores. Checked in
    a fresh interpreter holding torch and the kernel only, as the server does: the test process itself
    may hold another package's runtime (scikit-learn's, imported by sentence-transformers' tests)."""
    code = (
        "import ctypes, pathlib, sys, torch\n"
        "ctypes.CDLL(sys.argv[1])\n"
        "maps = pathlib.Path('/proc/self/maps').read_text().splitlines()\n"
        "print('\\n'.join(sorted({l.split()[-1] for l in maps if any(k in l for k in ('libgomp', 'libiomp', 'libomp'))})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(kernel.path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    runtimes = set(out.stdout.split())
    assert len(runtimes) == 1, runtimes
