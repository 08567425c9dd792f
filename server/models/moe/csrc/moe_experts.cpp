// One MoE block's routed experts in one call (server/models/moe/native.py): the T * top_k (token, expert,
// weight) pairs grouped by expert, each active expert's gate/up GEMM over its tokens, the activation, its
// down GEMM, and the weighted outputs summed per token. No Python per expert or per token.
//
// The GEMMs are not ours: the caller passes the quantized-linear entry point it would call for one
// projection (server/quant: kubeinfer_qgemv_q8, which hands what it does not take to qlinear's
// kubeinfer_qlinear, or kubeinfer_qlinear itself; for MXFP4 experts kubeinfer_mxfp4_linear) and each
// expert's weight descriptors, so faster kernels behind that entry point speed this loop up as they are.
// Each GEMM runs its own OpenMP team over its output columns; at one token an expert's GEMV has 1.5k
// (gate/up) or 2k (down) rows, enough to split over a few cores.
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
};
}

namespace {

struct Scratch {
  std::vector<int64_t> counts, offsets, fill, pairs;
  std::vector<float> xs, h13, act, y;
};

thread_local Scratch scratch;

inline void activate(const KiMoeExperts& c, const float* h13, float* act, int64_t rows) {
  const int64_t i = c.inter;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = h13 + r * 2 * i;
    const float* up = gate + i;
    float* a = act + r * i;
    if (c.activation == 0) {
      for (int64_t j = 0; j < i; ++j) {
        const float g = gate[j];
        a[j] = g / (1.0f + std::exp(-g)) * up[j];
      }
    } else {  // transformers GptOssExperts._apply_gate: gate clamped above only, up both ways
      const float lim = c.swiglu_limit, alpha = c.swiglu_alpha;
      for (int64_t j = 0; j < i; ++j) {
        const float g = std::min(gate[j], lim);
        const float u = std::clamp(up[j], -lim, lim);
        a[j] = (u + 1.0f) * (g * (1.0f / (1.0f + std::exp(-(g * alpha)))));
      }
    }
  }
}

int32_t linear(const KiMoeExperts& c, bool down, int64_t e, const float* x, int64_t m, const float* bias, float* y,
               int32_t nthreads) {
  const int64_t n = down ? c.hidden : 2 * c.inter, k = down ? c.inter : c.hidden;
  if (c.kind == 0) {
    const auto* base = static_cast<const uint8_t*>(down ? c.w2 : c.w13);
    return reinterpret_cast<ki_qlinear_fn>(c.qlinear)(base + e * c.desc_bytes, x, m, k, bias, y, n, nthreads);
  }
  const int64_t block_bytes = n * (k / 32) * 16, scale_bytes = n * (k / 32);
  const auto* blocks = static_cast<const uint8_t*>(down ? c.w2 : c.w13) + e * block_bytes;
  const auto* scales = static_cast<const uint8_t*>(down ? c.w2_scales : c.w13_scales) + e * scale_bytes;
  return reinterpret_cast<ki_mxfp4_fn>(c.mxfp4)(blocks, scales, n, k, x, m, k, bias, y, n, nthreads);
}

}  // namespace

extern "C" {

int32_t kubeinfer_moe_experts_abi() { return 1; }

// out[t, :] = sum_j weights[t, j] * down_e(act(gate_up_e(x[t, :]))) with e = ids[t, j], for t < tokens.
// x [tokens, H] fp32 rows `x_stride` apart; ids [tokens, top_k] int64; weights [tokens, top_k] fp32;
// out [tokens, H] fp32 contiguous, overwritten. Returns 0; 2 for bad arguments (null pointers, sizes,
// an expert id outside [0, E), a kind without its entry point); otherwise the first non-zero code of a
// GEMM (out is then unspecified).
int32_t kubeinfer_moe_experts(const KiMoeExperts* c, const float* x, int64_t tokens, int64_t x_stride,
                              const int64_t* ids, const float* weights, int64_t top_k, float* out, int32_t nthreads) {
  if (!c || !x || !ids || !weights || !out || tokens < 0 || top_k < 1 || c->num_experts < 1 || c->hidden < 1 ||
      c->inter < 1 || x_stride < c->hidden || !c->w13 || !c->w2)
    return 2;
  if (c->kind == 0 ? (!c->qlinear || c->desc_bytes < 1)
                   : (c->kind != 1 || !c->mxfp4 || !c->w13_scales || !c->w2_scales || c->hidden % 32 ||
                      c->inter % 32))
    return 2;
  const int64_t E = c->num_experts, H = c->hidden, I = c->inter, P = tokens * top_k;
  for (int64_t p = 0; p < P; ++p)
    if (ids[p] < 0 || ids[p] >= E) return 2;
  std::memset(out, 0, sizeof(float) * static_cast<size_t>(tokens * H));
  if (tokens == 0) return 0;

  Scratch& s = scratch;
  // counting sort of the pairs by expert, stable: token order within an expert
  s.counts.assign(E, 0);
  for (int64_t p = 0; p < P; ++p) ++s.counts[ids[p]];
  s.offsets.assign(E, 0);
  for (int64_t e = 1; e < E; ++e) s.offsets[e] = s.offsets[e - 1] + s.counts[e - 1];
  s.fill = s.offsets;
  s.pairs.resize(P);
  for (int64_t p = 0; p < P; ++p) s.pairs[s.fill[ids[p]]++] = p;
  const int64_t most = *std::max_element(s.counts.begin(), s.counts.end());
  s.xs.resize(static_cast<size_t>(most * H));
  s.h13.resize(static_cast<size_t>(most * 2 * I));
  s.act.resize(static_cast<size_t>(most * I));
  s.y.resize(static_cast<size_t>(most * H));

  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = s.counts[e];
    if (n == 0) continue;
    const int64_t* pe = s.pairs.data() + s.offsets[e];
    const float* xe;
    if (n == 1) {  // one token (decode at one user): its row as it is, no gather
      xe = x + (pe[0] / top_k) * x_stride;
    } else {
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(s.xs.data() + r * H, x + (pe[r] / top_k) * x_stride, sizeof(float) * static_cast<size_t>(H));
      xe = s.xs.data();
    }
    int32_t rc = linear(*c, false, e, xe, n, c->b13 ? c->b13 + e * 2 * I : nullptr, s.h13.data(), nthreads);
    if (rc != 0) return rc;
    activate(*c, s.h13.data(), s.act.data(), n);
    rc = linear(*c, true, e, s.act.data(), n, c->b2 ? c->b2 + e * H : nullptr, s.y.data(), nthreads);
    if (rc != 0) return rc;
    for (int64_t r = 0; r < n; ++r) {
      const float w = weights[pe[r]];
      const float* yr = s.y.data() + r * H;
      float* o = out + (pe[r] / top_k) * H;
      for (int64_t j = 0; j < H; ++j) o[j] += yr[j] * w;
    }
  }
  return 0;
}
}
