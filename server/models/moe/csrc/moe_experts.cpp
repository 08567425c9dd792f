// One MoE block's routed experts in one call (server/models/moe/native.py): the T * top_k (token, expert,
// weight) pairs grouped by expert, each active expert's gate/up GEMM over its tokens, the activation, its
// down GEMM, and the weighted outputs summed per token. No Python per expert or per token.
//
// The GEMMs are not ours: the caller passes the quantized-linear entry point it would call for one
// projection (server/quant: kubeinfer_qgemv_q8, which hands what it does not take to qlinear's
// kubeinfer_qlinear, or kubeinfer_qlinear itself; for MXFP4 experts kubeinfer_mxfp4_linear) and each
// expert's weight descriptors, so faster kernels behind that entry point speed this loop up as they are.
//
// Threads: one OpenMP team for the whole block, not one per GEMM (at one token a block is 2 * top_k
// GEMVs of a few microseconds each; a fork/join apiece costs as much again, and far more on a shared,
// oversubscribed machine, where a barrier waits for a descheduled thread). The work is split into tasks
// of task_rows (a multiple of ROWS: task_rows_for) output rows of one expert's W (a descriptor over those rows: the layout is row-major, so
// pointers move by rows), taken dynamically; each task calls the entry point with one thread (its own
// OpenMP region, if any, then runs inline). Phases, a barrier between each: gate/up tasks, activation,
// down tasks, then the weighted sums split by output column. The entry points must be re-entrant (they
// are: their scratch is per call).
//
// Order of the sums, as FusedMoE._grouped (server/models/moe/layer.py) does them: pairs sorted by expert
// (stable, so token order within an expert), out[t] starts at 0 and adds weight * y in ascending expert
// order. Only the activation differs from the torch path by rounding (std::exp against torch's vectorized
// exp): the outputs agree to fp32 rounding, not bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
// kubeinfer_qlinear's signature (server/quant/csrc/qlinear.cpp); `w` is a KiQWeight*.
typedef int32_t (*ki_qlinear_fn)(const void* w, const float* x, int64_t m, int64_t x_stride, const float* bias,
                                 float* y, int64_t y_stride, int32_t nthreads);
// kubeinfer_mxfp4_linear's (server/quant/csrc/mxfp4.cpp).
typedef int32_t (*ki_mxfp4_fn)(const uint8_t* blocks, const uint8_t* scales, int64_t n_rows, int64_t k,
                               const float* x, int64_t m, int64_t x_stride, const float* bias, float* y,
                               int64_t y_stride, int32_t nthreads);

// One block's experts. kind 0: `w13` / `w2` are arrays of num_experts descriptors `desc_bytes` apart
// (KiQWeight), run by `qlinear`. kind 1: MXFP4, `w13` = blocks [E, 2I, H/32, 16] then `w13_scales`
// [E, 2I, H/32], `w2` / `w2_scales` likewise [E, H, I/32, ...], run by `mxfp4`.
struct KiMoeExperts {
  int32_t kind;
  int32_t activation;  // 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU (swiglu_alpha, swiglu_limit)
  float swiglu_alpha, swiglu_limit;
  int64_t num_experts, hidden, inter;  // E, H, I
  const void* w13;
  const void* w13_scales;
  const void* w2;
  const void* w2_scales;
  int64_t desc_bytes;
  const float* b13;  // [E, 2I] or null
  const float* b2;   // [E, H] or null
  void* qlinear;     // ki_qlinear_fn (kind 0)
  void* mxfp4;       // ki_mxfp4_fn (kind 1)
  // kind 0: bytes per 16-row group of the descriptors' `packed` copies (the int8 batched path's layout,
  // made once at load: BlockQuantExperts.pack_int8), 0 where the experts have none. The copy is one
  // contiguous stream per 16 rows, so a task's rows r0.. (r0 a multiple of 16) start r0 / 16 groups in.
  int64_t w13_packed_group_bytes, w2_packed_group_bytes;
  int64_t task_rows;  // rows of W per task, a multiple of ROWS; 0: task_rows_for (benchmarks set it for A/B)
  int64_t batch_tokens;  // tokens per batch at most; 0: as many as BATCH_FLOATS of scratch hold (tests set it)
};
}

namespace {

// struct KiQWeight of server/quant/csrc/qlinear.cpp (server/quant/cpu_qlinear.py's ctypes twin): only
// the row pointers are moved here, the rest is passed on as it is.
struct KiQWeight {
  const uint8_t* q;
  const void* scales;
  const void* mins;
  int64_t n, k, group_size, groups, row_bytes;
  int32_t bits, zero_point, scale_is_f16, compute;
  const uint8_t* packed;  // qgemv_q8's packed copy: 16-row groups, each contiguous (see linear_rows)
};

constexpr int64_t PACK_ROWS = 16;  // rows per group of qgemv_q8's packed copy

constexpr int64_t ROWS = 96;  // rows per task: whole 4-row GEMV tiles, 12-row panels and 16-row groups
static_assert(ROWS % PACK_ROWS == 0, "a task's rows must start at a packed group");
// Scratch floats of one batch of tokens (gathered x, gate/up, activation and down rows: top_k * (2H + 3I) per
// token): 64 MiB at most, kept between calls. A longer prefill chunk runs as consecutive batches of equal
// size (a token's pairs all in one batch, so its sums keep their order). One call over a whole 2,048-token
// chunk of the 2.1B Qwen3-MoE shape needed 420 MB, zero-filled by the vectors' growth on the calling
// thread, page-faulted and unmapped again on every call: 160 us per token, against 87-102 us for one
// batch of 192-768 tokens in kept buffers (benchmarks/moe_block.py, bf16, 2-core Zen 5, 2026-12-05).
// Batches stay large because an expert's GEMM gets cheaper per row with more rows (its tiles unpacked
// once per 8 rows of x, its x quantized once per task). Each buffer stays under the heap's 64 MiB mmap
// threshold (server/cpu_env.py).
constexpr int64_t BATCH_FLOATS = int64_t{16} << 20;

// Rows per task: ROWS times as many as keeps TASKS_PER_THREAD tasks a thread in the larger GEMM phase. Each
// task is one call of the entry point, which quantizes its rows of x to int8 again and opens its own
// (one-thread) OpenMP region: at one token a 96-row task of Qwen3-MoE's gate/up (2048 columns) spent about
// a fifth of its time there, and 8 experts x 16 such tasks are far more than 2 threads need to balance.
constexpr int64_t TASKS_PER_THREAD = 8;

int64_t task_rows_for(int64_t active, int64_t rows, int64_t nthreads) {
  const int64_t tasks = active * ((rows + ROWS - 1) / ROWS);
  return ROWS * std::max<int64_t>(1, tasks / (TASKS_PER_THREAD * std::max<int64_t>(1, nthreads)));
}

struct Scratch {
  std::vector<int64_t> counts, offsets, fill, pairs, active;
  std::vector<float> xs, h13, act, y;
};

thread_local Scratch scratch;

inline void activate(const KiMoeExperts& c, const float* h13, float* act) {  // one row: [2I] -> [I]
  const int64_t i = c.inter;
  const float* gate = h13;
  const float* up = gate + i;
  if (c.activation == 0) {
    for (int64_t j = 0; j < i; ++j) {
      const float g = gate[j];
      act[j] = g / (1.0f + std::exp(-g)) * up[j];
    }
  } else {  // transformers GptOssExperts._apply_gate: gate clamped above only, up both ways
    const float lim = c.swiglu_limit, alpha = c.swiglu_alpha;
    for (int64_t j = 0; j < i; ++j) {
      const float g = std::min(gate[j], lim);
      const float u = std::clamp(up[j], -lim, lim);
      act[j] = (u + 1.0f) * (g * (1.0f / (1.0f + std::exp(-(g * alpha)))));
    }
  }
}

// y[r, :nr] (rows y_stride apart) = x[r, :] @ W_e[r0 : r0 + nr, :]^T (+ bias[r0 :]) for r < m, one thread.
int32_t linear_rows(const KiMoeExperts& c, bool down, int64_t e, int64_t r0, int64_t nr, const float* x,
                    int64_t x_stride, int64_t m, float* y, int64_t y_stride) {
  const int64_t n = down ? c.hidden : 2 * c.inter, k = down ? c.inter : c.hidden;
  const float* bias = down ? (c.b2 ? c.b2 + e * n : nullptr) : (c.b13 ? c.b13 + e * n : nullptr);
  if (bias) bias += r0;
  if (c.kind == 0) {
    const auto* base = static_cast<const uint8_t*>(down ? c.w2 : c.w13);
    KiQWeight w = *reinterpret_cast<const KiQWeight*>(base + e * c.desc_bytes);
    const int64_t scale_bytes = w.scale_is_f16 ? 2 : 4;
    w.q += r0 * w.row_bytes;
    w.scales = static_cast<const uint8_t*>(w.scales) + r0 * w.groups * scale_bytes;
    if (w.mins) w.mins = static_cast<const uint8_t*>(w.mins) + r0 * w.groups * scale_bytes;
    w.n = nr;
    // Without the packed copy the batched int8 path transposes and repacks these rows on every call
    // (most of a 16-user decode step's time on the 2.1B Qwen3-MoE shape); with it, it reads them in place.
    const int64_t group_bytes = down ? c.w2_packed_group_bytes : c.w13_packed_group_bytes;
    w.packed = w.packed && group_bytes > 0 ? w.packed + (r0 / PACK_ROWS) * group_bytes : nullptr;
    return reinterpret_cast<ki_qlinear_fn>(c.qlinear)(&w, x, m, x_stride, bias, y, y_stride, 1);
  }
  const int64_t nb = k / 32;
  const auto* blocks = static_cast<const uint8_t*>(down ? c.w2 : c.w13) + (e * n + r0) * nb * 16;
  const auto* scales = static_cast<const uint8_t*>(down ? c.w2_scales : c.w13_scales) + (e * n + r0) * nb;
  return reinterpret_cast<ki_mxfp4_fn>(c.mxfp4)(blocks, scales, nr, k, x, m, x_stride, bias, y, y_stride, 1);
}

// kubeinfer_moe_experts over one batch of tokens >= 1, arguments checked.
int32_t run_batch(const KiMoeExperts* c, const float* x, int64_t tokens, int64_t x_stride, const int64_t* ids,
                  const float* weights, int64_t top_k, float* out, int32_t nthreads) {
  const int64_t E = c->num_experts, H = c->hidden, I = c->inter, P = tokens * top_k;
  std::memset(out, 0, sizeof(float) * static_cast<size_t>(tokens * H));

  Scratch& s = scratch;
  // counting sort of the pairs by expert, stable: token order within an expert
  s.counts.assign(E, 0);
  for (int64_t p = 0; p < P; ++p) ++s.counts[ids[p]];
  s.offsets.assign(E, 0);
  for (int64_t e = 1; e < E; ++e) s.offsets[e] = s.offsets[e - 1] + s.counts[e - 1];
  s.fill = s.offsets;
  s.pairs.resize(P);
  for (int64_t p = 0; p < P; ++p) s.pairs[s.fill[ids[p]]++] = p;
  s.active.clear();
  for (int64_t e = 0; e < E; ++e)
    if (s.counts[e]) s.active.push_back(e);
  // rows of the buffers follow the sorted pairs: expert e's are offsets[e] .. offsets[e] + counts[e]
  s.xs.resize(static_cast<size_t>(P * H));
  s.h13.resize(static_cast<size_t>(P * 2 * I));
  s.act.resize(static_cast<size_t>(P * I));
  s.y.resize(static_cast<size_t>(P * H));
  const int64_t A = static_cast<int64_t>(s.active.size());
  const int64_t task_rows = c->task_rows > 0 ? c->task_rows : task_rows_for(A, std::max(2 * I, H), nthreads);
  if (task_rows % ROWS) return 2;
  const int64_t gu_chunks = (2 * I + task_rows - 1) / task_rows, down_chunks = (H + task_rows - 1) / task_rows;
  const int64_t cols = 256, col_chunks = (H + cols - 1) / cols;
  const int64_t* pairs = s.pairs.data();
  const int64_t* offsets = s.offsets.data();
  const int64_t* counts = s.counts.data();
  const int64_t* active = s.active.data();
  float *xs = s.xs.data(), *h13 = s.h13.data(), *act = s.act.data(), *y = s.y.data();
  int32_t failed = 0;
  const int nt = std::max(1, static_cast<int>(std::min<int64_t>(nthreads, A * std::max(gu_chunks, down_chunks))));

#pragma omp parallel num_threads(nt)
  {
    // gather each expert's tokens (one token: its row of x is read where it is)
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; ++r)
      std::memcpy(xs + r * H, x + (pairs[r] / top_k) * x_stride, sizeof(float) * static_cast<size_t>(H));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < A * gu_chunks; ++task) {
      const int64_t e = active[task / gu_chunks], r0 = (task % gu_chunks) * task_rows;
      const int64_t nr = std::min(task_rows, 2 * I - r0), off = offsets[e];
      const int32_t rc = linear_rows(*c, false, e, r0, nr, xs + off * H, H, counts[e], h13 + off * 2 * I + r0, 2 * I);
      if (rc != 0) {
#pragma omp atomic write
        failed = rc;
      }
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; ++r) activate(*c, h13 + r * 2 * I, act + r * I);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < A * down_chunks; ++task) {
      const int64_t e = active[task / down_chunks], r0 = (task % down_chunks) * task_rows;
      const int64_t nr = std::min(task_rows, H - r0), off = offsets[e];
      const int32_t rc = linear_rows(*c, true, e, r0, nr, act + off * I, I, counts[e], y + off * H + r0, H);
      if (rc != 0) {
#pragma omp atomic write
        failed = rc;
      }
    }
    // out[t] += w * y, experts in ascending order per output value, as FusedMoE._grouped's index_add_
#pragma omp for schedule(static)
    for (int64_t cc = 0; cc < col_chunks; ++cc) {
      const int64_t c0 = cc * cols, c1 = std::min(H, c0 + cols);
      for (int64_t r = 0; r < P; ++r) {
        const float w = weights[pairs[r]];
        const float* yr = y + r * H;
        float* o = out + (pairs[r] / top_k) * H;
        for (int64_t j = c0; j < c1; ++j) o[j] += yr[j] * w;
      }
    }
  }
  return failed;
}

}  // namespace

extern "C" {

int32_t kubeinfer_moe_experts_abi() { return 3; }

// out[t, :] = sum_j weights[t, j] * down_e(act(gate_up_e(x[t, :]))) with e = ids[t, j], for t < tokens.
// x [tokens, H] fp32 rows `x_stride` apart; ids [tokens, top_k] int64; weights [tokens, top_k] fp32;
// out [tokens, H] fp32 contiguous, overwritten. Returns 0; 2 for bad arguments (null pointers, sizes,
// an expert id outside [0, E), a kind without its entry point, a descriptor size other than KiQWeight's);
// otherwise the first non-zero code of a GEMM (out is then unspecified). Runs in batches of tokens whose
// scratch fits BATCH_FLOATS, of equal size.
int32_t kubeinfer_moe_experts(const KiMoeExperts* c, const float* x, int64_t tokens, int64_t x_stride,
                              const int64_t* ids, const float* weights, int64_t top_k, float* out, int32_t nthreads) {
  if (!c || !x || !ids || !weights || !out || tokens < 0 || top_k < 1 || c->num_experts < 1 || c->hidden < 1 ||
      c->inter < 1 || x_stride < c->hidden || !c->w13 || !c->w2 || c->batch_tokens < 0)
    return 2;
  if (c->kind == 0 ? (!c->qlinear || c->desc_bytes != static_cast<int64_t>(sizeof(KiQWeight)))
                   : (c->kind != 1 || !c->mxfp4 || !c->w13_scales || !c->w2_scales || c->hidden % 32 ||
                      c->inter % 32))
    return 2;
  const int64_t E = c->num_experts, H = c->hidden, I = c->inter;
  for (int64_t p = 0; p < tokens * top_k; ++p)
    if (ids[p] < 0 || ids[p] >= E) return 2;
  if (tokens == 0) return 0;
  const int64_t most =
      c->batch_tokens > 0 ? c->batch_tokens : std::max<int64_t>(1, BATCH_FLOATS / (top_k * (2 * H + 3 * I)));
  const int64_t batches = (tokens + most - 1) / most, batch = (tokens + batches - 1) / batches;
  for (int64_t t0 = 0; t0 < tokens; t0 += batch) {
    const int32_t rc = run_batch(c, x + t0 * x_stride, std::min(batch, tokens - t0), x_stride, ids + t0 * top_k,
                                 weights + t0 * top_k, top_k, out + t0 * H, nthreads);
    if (rc != 0) return rc;
  }
  return 0;
}
}
