// Fused elementwise ops of a Llama decoder layer for CPU, fp32: what torch runs as 5-10 small ops each.
//
// Built at run time by server/models/cpu_fused.py (through server/native.py) and called via ctypes: a plain
// C ABI, no torch headers. In a decode step every op of the layer loop costs more in dispatch than in math
// (one token: 576 values per RMSNorm), so each function here replaces a chain of torch ops with one call:
//   add_rms_norm   x += delta (optional); out = weight * x * rsqrt(mean(x^2) + eps)   [T, H] rows
//                  (add_rms_norm_mixed: the same with a bf16 delta and/or a bf16 out, for bf16 GEMMs)
//   rotary         q/k heads rotated in place: x * cos + rotate_half(x) * sin, "sin" with its first half
//                  negated (server/models/llama.py's RotaryEmbedding tables)              [T, heads, D]
//   silu_mul       out = silu(gate) * up, gate and up the two halves of one row          [T, 2I] -> [T, I]
//   silu_mul_bf16  the same over bf16 rows (the bf16 GEMM's own result) to bf16: each row widened to fp32,
//                  silu_mul's very loop, rounded to nearest even: bit-identical to widen -> silu_mul ->
//                  round, without the two fp32 [T, 2I] / [T, I] tensors in memory
//   head_rms_norm  each head normalized in place: x = weight * x * rsqrt(mean(x^2) + eps), one [D]
//                  weight for all heads (Qwen3's q_norm / k_norm, before the rotary)     [T, heads, D]
// Rows are independent; OpenMP over rows only when there is enough work to pay for waking the threads.
//
// kubeinfer_decode_forward runs a whole decode step's decoder layers in one call (the "decode graph",
// server/models/decode_graph.py): per layer add_rms_norm, the qkv projection, (Qwen3: q/k head_rms_norm,) rotary, the K/V store, paged
// decode attention, o, add_rms_norm, gate_up, silu_mul, down, each the very function the torch-driven path
// calls (the projections and the attention through function pointers into their own libraries), in the
// same order on the same buffers: the result is bit-identical, minus ~300 us of Python per layer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kParallelMin = 1 << 16;  // elements below which one thread does the whole op

// One row of add_rms_norm, the loop both entry points run (noinline: one codegen, so the mixed-dtype
// variant's fp32 values are the fp32 kernel's bit for bit). delta may be null.
__attribute__((noinline)) void add_rms_norm_row(float* xr, const float* dr, const float* weight, float* orow,
                                                int64_t dim, float eps) {
  float ss = 0.0f;
  if (dr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) {
      const float v = xr[i] + dr[i];
      xr[i] = v;
      ss += v * v;
    }
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) orow[i] = weight[i] * (xr[i] * inv);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, NaN kept quiet: what torch's fp32 -> bf16 conversion does.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

extern "C" {

int32_t kubeinfer_cpu_fused_abi() { return 6; }

// x, delta, out: [rows, dim] with row strides (elements); weight: [dim]. delta may be null.
int32_t kubeinfer_add_rms_norm(float* x, int64_t x_stride, const float* delta, int64_t delta_stride,
                               const float* weight, float* out, int64_t out_stride, int64_t rows,
                               int64_t dim, float eps, int32_t threads) {
  if (rows < 0 || dim <= 0) return 1;
#pragma omp parallel for num_threads(threads) if (rows * dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    add_rms_norm_row(x + r * x_stride, delta ? delta + r * delta_stride : nullptr, weight, out + r * out_stride,
                     dim, eps);
  }
  return 0;
}

// x: [rows, heads, d], head h of row r at x + r * row_stride + h * d; cos, sin: [rows, d] contiguous.
int32_t kubeinfer_rotary(float* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
                         const float* cos, const float* sin, int32_t threads) {
  if (rows < 0 || heads <= 0 || d <= 0 || d % 2) return 1;
  const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * d >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * d;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
  return 0;
}

}  // extern "C"

namespace {

// One row of silu_mul, the loop both entry points run (noinline: one codegen, so the bf16 variant's fp32
// values are the fp32 kernel's bit for bit).
// -ffast-math assumes no infinities: exp's argument is clamped below its overflow (e^88 < FLT_MAX), where
// g / (1 + e^-g) is already -0 to fp32 precision.
__attribute__((noinline)) void silu_mul_row(const float* g, const float* u, float* o, int64_t inter) {
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(std::min(-g[i], 88.0f))) * u[i];
}

constexpr int64_t kBf16Chunk = 1024;  // values widened per pass: three fp32 chunks stay in L1

}  // namespace

extern "C" {

// gate_up: [rows, 2 * inter] (gate then up) with row stride; out: [rows, inter] with row stride.
int32_t kubeinfer_silu_mul(const float* gate_up, int64_t in_stride, float* out, int64_t out_stride,
                           int64_t rows, int64_t inter, int32_t threads) {
  if (rows < 0 || inter <= 0) return 1;
#pragma omp parallel for num_threads(threads) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * in_stride;
    silu_mul_row(g, g + inter, out + r * out_stride, inter);
  }
  return 0;
}

// silu_mul over bf16 (raw uint16 bits): gate_up [rows, 2 * inter], out [rows, inter], row strides in
// elements. Works in chunks of kBf16Chunk values; each chunk runs silu_mul_row from the same offset
// within the row as the fp32 kernel's vector lanes would (chunks are a multiple of the vector width).
int32_t kubeinfer_silu_mul_bf16(const uint16_t* gate_up, int64_t in_stride, uint16_t* out, int64_t out_stride,
                                int64_t rows, int64_t inter, int32_t threads) {
  if (rows < 0 || inter <= 0) return 1;
#pragma omp parallel for num_threads(threads) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    alignas(64) float g[kBf16Chunk], u[kBf16Chunk], o[kBf16Chunk];
    const uint16_t* gr = gate_up + r * in_stride;
    const uint16_t* ur = gr + inter;
    uint16_t* orow = out + r * out_stride;
    for (int64_t c = 0; c < inter; c += kBf16Chunk) {
      const int64_t n = std::min(kBf16Chunk, inter - c);
      for (int64_t i = 0; i < n; ++i) {
        g[i] = bf16_to_float(gr[c + i]);
        u[i] = bf16_to_float(ur[c + i]);
      }
      silu_mul_row(g, u, o, n);
      for (int64_t i = 0; i < n; ++i) orow[c + i] = float_to_bf16(o[i]);
    }
  }
  return 0;
}

// add_rms_norm with a bf16 delta (delta_bf16 = 1: raw uint16 bits, widened exactly) and/or a bf16 out
// (out_bf16 = 1: rounded to nearest even): bit-identical to widening delta, running the fp32 kernel and
// rounding its out (the bf16 GEMMs' result goes in and their operand comes out without fp32 copies).
int32_t kubeinfer_add_rms_norm_mixed(float* x, int64_t x_stride, const void* delta, int64_t delta_stride,
                                     int32_t delta_bf16, const float* weight, void* out, int64_t out_stride,
                                     int32_t out_bf16, int64_t rows, int64_t dim, float eps, int32_t threads) {
  if (rows < 0 || dim <= 0) return 1;
#pragma omp parallel num_threads(threads) if (rows * dim >= kParallelMin)
  {
    std::vector<float> dbuf(delta && delta_bf16 ? dim : 0), obuf(out_bf16 ? dim : 0);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      const float* dr = nullptr;
      if (delta && delta_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(delta) + r * delta_stride;
        for (int64_t i = 0; i < dim; ++i) dbuf[i] = bf16_to_float(src[i]);
        dr = dbuf.data();
      } else if (delta) {
        dr = static_cast<const float*>(delta) + r * delta_stride;
      }
      if (out_bf16) {
        add_rms_norm_row(x + r * x_stride, dr, weight, obuf.data(), dim, eps);
        uint16_t* dst = static_cast<uint16_t*>(out) + r * out_stride;
        for (int64_t i = 0; i < dim; ++i) dst[i] = float_to_bf16(obuf[i]);
      } else {
        add_rms_norm_row(x + r * x_stride, dr, weight, static_cast<float*>(out) + r * out_stride, dim, eps);
      }
    }
  }
  return 0;
}

// x: [rows, heads, d], head h of row r at x + r * row_stride + h * d, normalized in place; weight: [d].
int32_t kubeinfer_head_rms_norm(float* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
                                const float* weight, float eps, int32_t threads) {
  if (rows < 0 || heads <= 0 || d <= 0) return 1;
#pragma omp parallel for num_threads(threads) if (rows * heads * d >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * d;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) ss += v[i] * v[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) v[i] = weight[i] * (v[i] * inv);
    }
  }
  return 0;
}

// ---- the decode graph --------------------------------------------------------------------------------

// server/quant/csrc/qlinear.cpp's kubeinfer_qlinear and server/attention/csrc/paged_decode.cpp's
// kubeinfer_paged_decode (the weight descriptor stays opaque here).
typedef int32_t (*KiQLinearFn)(const void* w, const float* x, int64_t m, int64_t x_stride, const float* bias,
                               float* y, int64_t y_stride, int32_t nthreads);
typedef int32_t (*KiPagedDecodeFn)(int32_t dtype, int32_t cache_dtype, void* out, const void* q, const void* k_cache,
                                   const void* v_cache, const int32_t* block_tables,
                                   const int32_t* context_lens, const int64_t* seqs, const int64_t* rows,
                                   int64_t num_decode, int64_t q_row_stride, int64_t out_row_stride,
                                   int64_t bt_stride, int32_t hq, int32_t hkv, int32_t d, int32_t block_size,
                                   float scale, int32_t num_threads);
typedef int32_t (*KiKvStoreFn)(int32_t cache_dtype, void* k_cache, void* v_cache, const int64_t* slots,
                               const float* k, const float* v, int64_t src_stride, int64_t t, int64_t width);

// What stays fixed while the model serves: weights (qlinear descriptors, biases may be null), norms, caches.
struct KiDecodeLayer {
  const void* qkv;
  const float* qkv_bias;
  const void* o;
  const float* o_bias;
  const void* gate_up;
  const float* gate_up_bias;
  const void* down;
  const float* down_bias;
  const float* norm1;  // input_layernorm.weight [H]
  const float* norm2;  // post_attention_layernorm.weight [H]
  void* k_cache;       // [num_blocks, block_size, Hkv, D] of the model's cache_dtype
  void* v_cache;
  float eps1, eps2;
  const float* q_norm;  // Qwen3: self_attn.q_norm.weight [D], k_norm.weight [D]; null for other models
  const float* k_norm;
  float qk_eps;
};

struct KiDecodeModel {
  const KiDecodeLayer* layers;
  int64_t num_layers;
  const float* final_norm;  // [H]
  float final_eps, scale;
  int64_t hidden, inter, hq, hkv, d, block_size;
  KiQLinearFn qlinear;
  KiPagedDecodeFn paged_decode;
  KiKvStoreFn kv_store;    // paged_decode.cpp's K/V write, rounding to the cache's dtype
  int32_t cache_dtype;     // 0 = float32, 1 = bfloat16, 2 = float16 (paged_decode.cpp's codes)
};

// One step of T decode rows (row i is sequence i), its indices already bounds-checked by the caller.
struct KiDecodeStep {
  float* h;                     // [T, H] the embeddings in; the residual stream after the last layer out
  float* out;                   // [T, H] final_norm(h)
  int64_t t;
  const float* cos;             // [T, D]
  const float* sin;             // [T, D]
  const int64_t* slots;         // [T] cache slot of each row's new K/V
  const int32_t* block_tables;  // [T, bt_stride]
  int64_t bt_stride;
  const int32_t* context_lens;  // [T]
  const int64_t* seqs;          // [T] 0..T-1
  // scratch
  float* x;        // [T, H]
  float* qkv;      // [T, (Hq + 2 Hkv) D]
  float* attn;     // [T, Hq D]
  float* gate_up;  // [T, 2 I]
  float* act;      // [T, I]
  float* delta;    // [T, H]
  int32_t threads;
};

int32_t kubeinfer_decode_forward(const KiDecodeModel* m, const KiDecodeStep* s) {
  const int64_t t = s->t, H = m->hidden, I = m->inter, D = m->d;
  const int64_t q_width = (m->hq + 2 * m->hkv) * D, kv_width = m->hkv * D, o_width = m->hq * D;
  const int32_t nt = s->threads;
  int32_t rc;
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const KiDecodeLayer& L = m->layers[l];
    if ((rc = kubeinfer_add_rms_norm(s->h, H, l ? s->delta : nullptr, H, L.norm1, s->x, H, t, H, L.eps1, nt)))
      return 100 + rc;
    if ((rc = m->qlinear(L.qkv, s->x, t, H, L.qkv_bias, s->qkv, q_width, nt))) return 200 + rc;
    if (L.q_norm) {
      if ((rc = kubeinfer_head_rms_norm(s->qkv, q_width, t, m->hq, D, L.q_norm, L.qk_eps, nt))) return 1000 + rc;
      if ((rc = kubeinfer_head_rms_norm(s->qkv + o_width, q_width, t, m->hkv, D, L.k_norm, L.qk_eps, nt)))
        return 1100 + rc;
    }
    if ((rc = kubeinfer_rotary(s->qkv, q_width, t, m->hq + m->hkv, D, s->cos, s->sin, nt))) return 300 + rc;
    if ((rc = m->kv_store(m->cache_dtype, L.k_cache, L.v_cache, s->slots, s->qkv + o_width,
                          s->qkv + o_width + kv_width, q_width, t, kv_width)))
      return 1200 + rc;
    if ((rc = m->paged_decode(0, m->cache_dtype, s->attn, s->qkv, L.k_cache, L.v_cache, s->block_tables, s->context_lens,
                              s->seqs, s->seqs, t, q_width, o_width, s->bt_stride, m->hq, m->hkv, D,
                              m->block_size, m->scale, nt)))
      return 400 + rc;
    if ((rc = m->qlinear(L.o, s->attn, t, o_width, L.o_bias, s->delta, H, nt))) return 500 + rc;
    if ((rc = kubeinfer_add_rms_norm(s->h, H, s->delta, H, L.norm2, s->x, H, t, H, L.eps2, nt))) return 600 + rc;
    if ((rc = m->qlinear(L.gate_up, s->x, t, H, L.gate_up_bias, s->gate_up, 2 * I, nt))) return 700 + rc;
    if ((rc = kubeinfer_silu_mul(s->gate_up, 2 * I, s->act, I, t, I, nt))) return 800 + rc;
    if ((rc = m->qlinear(L.down, s->act, t, I, L.down_bias, s->delta, H, nt))) return 900 + rc;
  }
  return kubeinfer_add_rms_norm(s->h, H, m->num_layers ? s->delta : nullptr, H, m->final_norm, s->out, H, t, H,
                                m->final_eps, nt);
}

}  // extern "C"
