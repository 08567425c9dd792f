// Fused elementwise ops of a decoder layer for CPU, fp32: what torch runs as 5-10 small ops each.
//
// Built at run time by server/models/cpu_fused.py (through server/native.py) and called via ctypes: a plain
// C ABI, no torch headers. In a decode step every op of the layer loop costs more in dispatch than in math
// (one token: 576 values per RMSNorm), so each function here replaces a chain of torch ops with one call:
//   add_rms_norm   x += delta (optional); out = weight * x * rsqrt(mean(x^2) + eps)   [T, H] rows
//                  (add_rms_norm_mixed: the same with a bf16 delta and/or a bf16 out, for bf16 GEMMs)
//   rotary         q/k heads rotated in place: x * cos + rotate_half(x) * sin, "sin" with its first half
//                  negated (server/models/rope.py's RotaryEmbedding tables); only the leading R <= D
//                  channels of each head rotate (Phi-3's partial rotary)                 [T, heads, D]
//   residual_norm  the general residual step of every norm placement (layer_spec.py): delta normalized
//                  in place by a post-norm (OLMo 2, Gemma 2/3) where given, x += mult * delta (Granite's
//                  residual multiplier), out = norm(x) where a next norm is given   [T, H] rows
//   gelu_tanh_mul  out = gelu_tanh(gate) * up (GeGLU, Gemma), fp32 and bf16 like silu_mul
//   silu_mul       out = silu(gate) * up, gate and up the two halves of one row          [T, 2I] -> [T, I]
//   silu_mul_bf16  the same over bf16 rows (the bf16 GEMM's own result) to bf16: each row widened to fp32,
//                  silu_mul's very loop, rounded to nearest even: bit-identical to widen -> silu_mul ->
//                  round, without the two fp32 [T, 2I] / [T, I] tensors in memory
//   head_rms_norm  each head normalized in place: x = weight * x * rsqrt(mean(x^2) + eps), one [D]
//                  weight for all heads (Qwen3's q_norm / k_norm, before the rotary)     [T, heads, D]
//   *_bf16         residual_norm (add + norm too), rotary and head_rms_norm over a bf16 residual stream: the
//                  fp32 row functions on widened values, each written value rounded once
//   argmax_rows    each fp32 row's torch.argmax (greedy sampling's token), in integer compares
// Rows are independent; OpenMP over rows only when there is enough work to pay for waking the threads.
//
// kubeinfer_decode_forward runs a whole decode step's decoder layers in one call (the "decode graph",
// server/models/decode_graph.py): per layer residual_norm, the qkv projection, q/k norms (per head or over
// the projection), rotary (per layer table, partial or none), the K/V store, paged decode attention (the
// layer's scale, window, sinks and soft-cap), o, residual_norm, gate_up, silu_mul or gelu_tanh_mul, down, each the
// very function the torch-driven fused path calls (the projections and the attention through function
// pointers into their own libraries), in the same order on the same buffers: the result is bit-identical,
// minus ~300 us of Python per layer. The layer kind is data in KiDecodeLayer, not a branch per family.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

// IEEE half -> float (the fp16 KV cache), subnormals and inf/NaN included.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113u;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// kubeinfer_argmax_rows' order on fp32 bits: numbers as their values (negatives' magnitude bits flipped,
// -0 as +0), every NaN above +inf.
constexpr int kArgmaxLanes = 16;

inline int32_t argmax_key(int32_t b) {
  const int32_t mag = b & 0x7fffffff;
  if (mag > 0x7f800000) return INT32_MAX;
  return b < 0 ? (mag == 0 ? 0 : b ^ 0x7fffffff) : b;
}

// Lane l of best / idx: the largest key among bits[i], i = l mod 16, over the leading multiple of 16 values,
// and its first index (-1 and INT32_MIN where none); returns where the lanes stopped.
inline int64_t argmax_lanes(const int32_t* bits, int64_t cols, int32_t* best, int32_t* idx) {
  const int64_t body = cols - cols % kArgmaxLanes;
#ifdef __AVX512F__
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i nan_key = _mm512_set1_epi32(INT32_MAX), zero = _mm512_setzero_si512();
  const __m512i step = _mm512_set1_epi32(kArgmaxLanes);
  __m512i top = _mm512_set1_epi32(INT32_MIN), at = _mm512_set1_epi32(-1);
  __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i0 = 0; i0 < body; i0 += kArgmaxLanes) {
    const __m512i b = _mm512_loadu_si512(bits + i0);
    const __m512i mag = _mm512_and_si512(b, abs_mask);
    const __mmask16 neg = _mm512_cmplt_epi32_mask(b, zero);
    const __mmask16 neg_nonzero = neg & _mm512_cmpneq_epi32_mask(mag, zero);
    __m512i key = _mm512_mask_xor_epi32(b, neg_nonzero, b, abs_mask);
    key = _mm512_mask_mov_epi32(key, neg & static_cast<__mmask16>(~neg_nonzero), zero);  // -0 as +0
    key = _mm512_mask_mov_epi32(key, _mm512_cmpgt_epi32_mask(mag, inf), nan_key);
    const __mmask16 gt = _mm512_cmpgt_epi32_mask(key, top);
    top = _mm512_mask_mov_epi32(top, gt, key);
    at = _mm512_mask_mov_epi32(at, gt, lane);
    lane = _mm512_add_epi32(lane, step);
  }
  _mm512_storeu_si512(best, top);
  _mm512_storeu_si512(idx, at);
#else
  for (int l = 0; l < kArgmaxLanes; ++l) {
    best[l] = INT32_MIN;
    idx[l] = -1;
  }
  for (int64_t i0 = 0; i0 < body; i0 += kArgmaxLanes) {
    for (int l = 0; l < kArgmaxLanes; ++l) {
      const int32_t k = argmax_key(bits[i0 + l]);
      if (k > best[l]) {
        best[l] = k;
        idx[l] = static_cast<int32_t>(i0 + l);
      }
    }
  }
#endif
  return body;
}

// A stream value widened to fp32 and an fp32 value written back: the identity for fp32, exact widening and
// rounding to nearest even for bf16 (raw uint16 bits), so one loop serves both streams.
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_float(v); }
inline void narrow(float v, float* dst) { *dst = v; }
inline void narrow(float v, uint16_t* dst) { *dst = float_to_bf16(v); }

// The rotary of kubeinfer_rotary / kubeinfer_rotary_bf16 (see there) over a stream of T.
template <typename T>
int32_t rotary(T* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_stride, int64_t r_dim,
               const float* cos, const float* sin, int32_t threads) {
  if (rows < 0 || heads <= 0 || r_dim <= 0 || r_dim % 2 || r_dim > head_stride) return 1;
  const int64_t half = r_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * r_dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * r_dim;
    const float* s = sin + r * r_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * row_stride + h * head_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = widen(v[i]), b = widen(v[i + half]);
        narrow(a * c[i] + b * s[i], v + i);
        narrow(b * c[i + half] + a * s[i + half], v + i + half);
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int32_t kubeinfer_cpu_fused_abi() { return 13; }

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

// x: [rows, heads, d], head h of row r at x + r * row_stride + h * head_stride; the leading r_dim
// channels of each head rotate (r_dim <= head_stride, even); cos, sin: [rows, r_dim] contiguous.
int32_t kubeinfer_rotary(float* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_stride,
                         int64_t r_dim, const float* cos, const float* sin, int32_t threads) {
  return rotary(x, row_stride, rows, heads, head_stride, r_dim, cos, sin, threads);
}

// One residual step (see the header) over rows: x [rows, dim] the residual stream, updated in place;
// delta [rows, dim] or null (nothing to add), normalized in place by post_w [dim] where post_w is given;
// out [rows, dim] = next_w * norm(x) where next_w is given (else untouched). mult 1 with no post_w runs
// add_rms_norm's own row loop, so the Llama layer's values are kubeinfer_add_rms_norm's bit for bit.
int32_t kubeinfer_residual_norm(float* x, int64_t x_stride, float* delta, int64_t delta_stride,
                                const float* post_w, float post_eps, float mult, const float* next_w,
                                float next_eps, float* out, int64_t out_stride, int64_t rows, int64_t dim,
                                int32_t threads) {
  if (rows < 0 || dim <= 0) return 1;
#pragma omp parallel for num_threads(threads) if (rows * dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * x_stride;
    float* dr = delta ? delta + r * delta_stride : nullptr;
    float* orow = next_w ? out + r * out_stride : nullptr;
    if (dr && post_w) add_rms_norm_row(dr, nullptr, post_w, dr, dim, post_eps);
    if (dr && mult != 1.0f) {
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) xr[i] += mult * dr[i];
      dr = nullptr;
    }
    if (orow) {
      add_rms_norm_row(xr, dr, next_w, orow, dim, next_eps);
    } else if (dr) {
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) xr[i] += dr[i];
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

// GELU with the tanh approximation (transformers' gelu_pytorch_tanh) times up, written through the
// identity 0.5 (1 + tanh(y)) = 1 / (1 + e^(-2y)), y = sqrt(2/pi) (g + 0.044715 g^3): one vectorized exp
// as in silu_mul_row (libmvec has no tanh at every glibc we build on); within ~1e-7 relative of torch's.
__attribute__((noinline)) void gelu_tanh_mul_row(const float* g, const float* u, float* o, int64_t inter) {
  constexpr float k2 = 2.0f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) {
    const float v = g[i];
    const float y2 = k2 * (v + 0.044715f * v * v * v);
    o[i] = v / (1.0f + std::exp(std::min(-y2, 88.0f))) * u[i];
  }
}

typedef void (*ActRowFn)(const float*, const float*, float*, int64_t);

constexpr int64_t kBf16Chunk = 1024;  // values widened per pass: three fp32 chunks stay in L1

int32_t act_mul(ActRowFn row, const float* gate_up, int64_t in_stride, float* out, int64_t out_stride,
                int64_t rows, int64_t inter, int32_t threads) {
  if (rows < 0 || inter <= 0) return 1;
#pragma omp parallel for num_threads(threads) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * in_stride;
    row(g, g + inter, out + r * out_stride, inter);
  }
  return 0;
}

// Over bf16 (raw uint16 bits), in chunks of kBf16Chunk values; each chunk runs the row function from the
// same offset within the row as the fp32 kernel's vector lanes would (chunks are a multiple of the width).
int32_t act_mul_bf16(ActRowFn row, const uint16_t* gate_up, int64_t in_stride, uint16_t* out,
                     int64_t out_stride, int64_t rows, int64_t inter, int32_t threads) {
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
      row(g, u, o, n);
      for (int64_t i = 0; i < n; ++i) orow[c + i] = float_to_bf16(o[i]);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// gate_up: [rows, 2 * inter] (gate then up) with row stride; out: [rows, inter] with row stride.
int32_t kubeinfer_silu_mul(const float* gate_up, int64_t in_stride, float* out, int64_t out_stride,
                           int64_t rows, int64_t inter, int32_t threads) {
  return act_mul(silu_mul_row, gate_up, in_stride, out, out_stride, rows, inter, threads);
}

int32_t kubeinfer_gelu_tanh_mul(const float* gate_up, int64_t in_stride, float* out, int64_t out_stride,
                                int64_t rows, int64_t inter, int32_t threads) {
  return act_mul(gelu_tanh_mul_row, gate_up, in_stride, out, out_stride, rows, inter, threads);
}

// silu_mul over bf16 (raw uint16 bits): gate_up [rows, 2 * inter], out [rows, inter], row strides in
// elements: bit-identical to widen -> silu_mul -> round to nearest even.
int32_t kubeinfer_silu_mul_bf16(const uint16_t* gate_up, int64_t in_stride, uint16_t* out, int64_t out_stride,
                                int64_t rows, int64_t inter, int32_t threads) {
  return act_mul_bf16(silu_mul_row, gate_up, in_stride, out, out_stride, rows, inter, threads);
}

int32_t kubeinfer_gelu_tanh_mul_bf16(const uint16_t* gate_up, int64_t in_stride, uint16_t* out,
                                     int64_t out_stride, int64_t rows, int64_t inter, int32_t threads) {
  return act_mul_bf16(gelu_tanh_mul_row, gate_up, in_stride, out, out_stride, rows, inter, threads);
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

// ---- a bf16 residual stream (a bf16 model served in bf16: LlamaForCausalLM's bf16 fused path) ---------
// Each op widens its bf16 operands exactly, runs the fp32 kernel's own row function and rounds each value it
// writes once to nearest even, as vLLM's CPU bf16 kernels do; torch's op chains round after every op (the
// Llama norm twice, the rotary three times), so values differ from those chains by at most one bf16 ulp.

// kubeinfer_residual_norm over a bf16 stream (every norm placement and multiplier: Gemma 2/3's sandwich,
// OLMo 2's post-norms, Granite's multiplier): x, delta, out [rows, dim] bf16 (raw uint16 bits) with row
// strides; post_w, next_w [dim] fp32 or null. delta is widened and, with post_w, normalized and rounded (the
// sub-block's bf16 output, written back in place); x becomes round(x + mult * delta); out = the next norm of
// that rounded x, rounded. The fp32 entry's row functions on widened values. With no post_w and mult 1 it is
// the bf16 stream's add + norm (FusedOps.add_rms_norm over bf16): x = round(x + delta), out = its norm.
int32_t kubeinfer_residual_norm_bf16(uint16_t* x, int64_t x_stride, uint16_t* delta, int64_t delta_stride,
                                     const float* post_w, float post_eps, float mult, const float* next_w,
                                     float next_eps, uint16_t* out, int64_t out_stride, int64_t rows, int64_t dim,
                                     int32_t threads) {
  if (rows < 0 || dim <= 0) return 1;
#pragma omp parallel num_threads(threads) if (rows * dim >= kParallelMin)
  {
    std::vector<float> xbuf(dim), dbuf(delta ? dim : 0), obuf(next_w ? dim : 0);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* xr = x + r * x_stride;
      if (delta) {
        uint16_t* dr = delta + r * delta_stride;
        for (int64_t i = 0; i < dim; ++i) dbuf[i] = bf16_to_float(dr[i]);
        if (post_w) {
          add_rms_norm_row(dbuf.data(), nullptr, post_w, dbuf.data(), dim, post_eps);
          for (int64_t i = 0; i < dim; ++i) {
            dr[i] = float_to_bf16(dbuf[i]);
            dbuf[i] = bf16_to_float(dr[i]);
          }
        }
        for (int64_t i = 0; i < dim; ++i) {
          xr[i] = float_to_bf16(bf16_to_float(xr[i]) + mult * dbuf[i]);
          xbuf[i] = bf16_to_float(xr[i]);
        }
      } else if (next_w) {
        for (int64_t i = 0; i < dim; ++i) xbuf[i] = bf16_to_float(xr[i]);
      }
      if (next_w) {
        add_rms_norm_row(xbuf.data(), nullptr, next_w, obuf.data(), dim, next_eps);
        uint16_t* orow = out + r * out_stride;
        for (int64_t i = 0; i < dim; ++i) orow[i] = float_to_bf16(obuf[i]);
      }
    }
  }
  return 0;
}

// kubeinfer_rotary over a bf16 x (raw uint16 bits, same layout and strides); cos, sin fp32 [rows, r_dim]
// contiguous. Each rotated value is a * c + b * s in fp32, rounded once.
int32_t kubeinfer_rotary_bf16(uint16_t* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_stride,
                              int64_t r_dim, const float* cos, const float* sin, int32_t threads) {
  return rotary(x, row_stride, rows, heads, head_stride, r_dim, cos, sin, threads);
}

}  // extern "C"

namespace {

// One head of head_rms_norm, in place (noinline: the bf16 entry runs the fp32 entry's arithmetic).
__attribute__((noinline)) void head_rms_norm_row(float* v, const float* weight, int64_t d, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += v[i] * v[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) v[i] = weight[i] * (v[i] * inv);
}

}  // namespace

extern "C" {

// kubeinfer_head_rms_norm over a bf16 x (raw uint16 bits, same layout): each head widened, normalized by the
// fp32 entry's arithmetic, rounded once; weight [d] fp32.
int32_t kubeinfer_head_rms_norm_bf16(uint16_t* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
                                     const float* weight, float eps, int32_t threads) {
  if (rows < 0 || heads <= 0 || d <= 0) return 1;
#pragma omp parallel num_threads(threads) if (rows * heads * d >= kParallelMin)
  {
    std::vector<float> buf(d);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* v = x + r * row_stride + h * d;
        for (int64_t i = 0; i < d; ++i) buf[i] = bf16_to_float(v[i]);
        head_rms_norm_row(buf.data(), weight, d, eps);
        for (int64_t i = 0; i < d; ++i) v[i] = float_to_bf16(buf[i]);
      }
    }
  }
  return 0;
}

// 1 where kubeinfer_argmax_rows runs its AVX-512 lanes; 0: the plain C++ ones, slower than torch's argmax
// (the sampler keeps torch's there).
int32_t kubeinfer_argmax_vectorized() {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

// out[r] = the index of row r's largest value, the first of equal ones, any NaN larger than every number
// (the first NaN): torch.argmax's answer. x: [rows, cols] fp32 with row stride, cols < 2^31. Each value's
// bits become an int32 key ordered as the floats are (argmax_key), and 16 lanes each keep their largest
// key and its first index: integer compares only, which mean the same under -ffast-math as without (no
// float compare sees an inf or a NaN). AVX-512 where the build has it (GCC left the plain loop scalar:
// 10x torch's), else the same lanes in plain C++.
int32_t kubeinfer_argmax_rows(const float* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t* out,
                              int32_t threads) {
  if (rows < 0 || cols <= 0 || cols > INT32_MAX) return 1;
#pragma omp parallel for num_threads(threads) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* bits = reinterpret_cast<const int32_t*>(x + r * x_stride);
    int32_t best[kArgmaxLanes], idx[kArgmaxLanes];
    int64_t i0 = argmax_lanes(bits, cols, best, idx);
    for (int64_t i = i0; i < cols; ++i) {  // the tail, lane by lane
      const int l = static_cast<int>(i - i0);
      const int32_t k = argmax_key(bits[i]);
      if (k > best[l]) {
        best[l] = k;
        idx[l] = static_cast<int32_t>(i);
      }
    }
    int32_t pick = -1, top = INT32_MIN;
    for (int l = 0; l < kArgmaxLanes; ++l) {
      if (idx[l] >= 0 && (pick < 0 || best[l] > top || (best[l] == top && idx[l] < pick))) {
        top = best[l];
        pick = idx[l];
      }
    }
    out[r] = pick;
  }
  return 0;
}

// x: [rows, heads, d], head h of row r at x + r * row_stride + h * d, normalized in place; weight: [d].
int32_t kubeinfer_head_rms_norm(float* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
                                const float* weight, float eps, int32_t threads) {
  if (rows < 0 || heads <= 0 || d <= 0) return 1;
#pragma omp parallel for num_threads(threads) if (rows * heads * d >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) head_rms_norm_row(x + r * row_stride + h * d, weight, d, eps);
  }
  return 0;
}

// ---- the decode graph --------------------------------------------------------------------------------

// server/quant/csrc/qlinear.cpp's kubeinfer_qlinear and server/attention/csrc/paged_decode.cpp's
// kubeinfer_kv_store and kubeinfer_paged_decode_capped (the weight descriptor stays opaque here).
typedef int32_t (*KiQLinearFn)(const void* w, const float* x, int64_t m, int64_t x_stride, const float* bias,
                               float* y, int64_t y_stride, int32_t nthreads);
typedef int32_t (*KiKvStoreFn)(int32_t cache_dtype, void* k_cache, void* v_cache, const int64_t* slots,
                               const float* k, const float* v, int64_t src_stride, int64_t t, int32_t hkv,
                               int32_t d, int32_t block_size);

typedef int32_t (*KiPagedDecodeCappedFn)(int32_t dtype, int32_t cache_dtype, void* out, const void* q,
                                         const void* k_cache, const void* v_cache, const int32_t* block_tables,
                                         const int32_t* context_lens, const int64_t* seqs, const int64_t* rows,
                                         int64_t num_decode, int64_t q_row_stride, int64_t out_row_stride,
                                         int64_t bt_stride, int32_t hq, int32_t hkv, int32_t d,
                                         int32_t block_size, float scale, int32_t window, const float* sinks,
                                         float softcap, int32_t num_threads);

// server/models/moe/csrc/moe_experts.cpp's kubeinfer_moe_experts (`spec` a KiMoeExperts*).
typedef int32_t (*KiMoeExpertsFn)(const void* spec, const float* x, int64_t tokens, int64_t x_stride,
                                  const int64_t* ids, const float* weights, int64_t top_k, float* out,
                                  int32_t nthreads);

// One layer as the layer contract (server/models/layer_spec.py) describes it, with what stays fixed while
// the model serves: weights (qlinear descriptors, biases may be null), norm weights as the kernels apply
// them (Gemma's (1 + w) already added), caches. A null norm is a norm the placement does not have:
//   pre (Llama):       attn_in, mlp_in          (attn_out, mlp_out null)
//   post (OLMo 2):     attn_out, mlp_out        (the sub-blocks read the residual stream itself)
//   sandwich (Gemma):  all four
struct KiDecodeLayer {
  const void* qkv;  // the fused q/k/v projection, or q alone where k_proj is set (GGUFs mixing types)
  const float* qkv_bias;
  const void* k_proj;  // null: qkv holds all three
  const float* k_bias;
  const void* v_proj;
  const float* v_bias;
  const void* o;
  const float* o_bias;
  const void* gate_up;
  const float* gate_up_bias;
  const void* down;
  const float* down_bias;
  const float* attn_in_norm;   // [H] input_layernorm
  const float* attn_out_norm;  // [H] post_attention_layernorm (post, sandwich)
  const float* mlp_in_norm;    // [H] post_attention_layernorm (pre) / pre_feedforward_layernorm (sandwich)
  const float* mlp_out_norm;   // [H] post_feedforward_layernorm (post, sandwich)
  float attn_in_eps, attn_out_eps, mlp_in_eps, mlp_out_eps;
  void* k_cache;  // [num_blocks, block_size, Hkv, D] of the model's cache_dtype
  void* v_cache;
  int32_t qk_norm;       // 0 none, 1 per head ([D] weights), 2 over the projection ([Hq D], [Hkv D] weights)
  const float* q_norm;
  const float* k_norm;
  float qk_eps;
  int32_t rope;          // index into the step's cos/sin tables; -1: no rotary (SmolLM3's NoPE layers)
  int32_t rotary_dim;    // leading channels of each head that rotate (<= D)
  float scale;           // softmax scale
  int32_t window;        // 0: full attention; W: the last W positions
  const float* sinks;    // [Hq] fp32 or null
  float residual_mult;   // each sub-block's output scaled before the residual add (Granite)
  int32_t activation;    // 0 silu, 1 gelu_tanh
  float attn_softcap;    // 0: none; cap > 0: scores cap * tanh(s / cap) (Gemma 2), in paged_decode
  int32_t kv_group;      // 0 or 1: the step's slots / block tables this layer's caches are indexed by
  const struct KiDecodeMoe* moe;  // null: the dense gate_up / act / down MLP; else this MoE block
};

// A mixture-of-experts MLP (server/models/moe): the router, top-k and the experts' one native call, and
// Qwen2-MoE's shared expert: sigmoid(x . shared_gate) * down(silu(gate) * up), its two projections through
// the model's qlinear entry like every other projection.
struct KiDecodeMoe {
  const float* router;       // [E, H] fp32
  const float* router_bias;  // [E] or null
  int64_t num_experts, top_k;
  int32_t routing;      // 0: softmax over E, then top-k (Mixtral, Qwen); 1: top-k of the logits, then softmax
  int32_t renormalize;  // routing 0: the chosen weights divided by their sum (Mixtral; Qwen3's norm_topk_prob)
  const void* experts;  // moe_experts.cpp's KiMoeExperts (its entry point set by the caller)
  const void* shared_gate_up;  // qlinear descriptor of [2S, H] (gate rows, then up rows); null: no shared expert
  const void* shared_down;     // [H, S]
  const float* shared_gate;    // [H] fp32
  int64_t shared_inter;        // S
};

struct KiDecodeModel {
  const KiDecodeLayer* layers;
  int64_t num_layers;
  const float* final_norm;  // [H]
  float final_eps;
  int64_t hidden, inter, hq, hkv, d, block_size;
  KiQLinearFn qlinear;
  KiPagedDecodeCappedFn paged_decode;  // paged_decode.cpp's kubeinfer_paged_decode_capped
  KiKvStoreFn kv_store;    // paged_decode.cpp's K/V write, rounding to the cache's dtype
  int32_t cache_dtype;     // 0 = float32, 1 = bfloat16, 2 = float16, 3 = int8 (paged_decode.cpp's codes)
  KiMoeExpertsFn moe_experts;  // moe_experts.cpp's kubeinfer_moe_experts; null when no layer is MoE
};

// One step of T decode rows (row i is sequence i), its indices already bounds-checked by the caller.
struct KiDecodeStep {
  float* h;                     // [T, H] the embeddings in; the residual stream after the last layer out
  float* out;                   // [T, H] final_norm(h)
  int64_t t;
  const float* const* cos;      // per rotary table: [T, rotary_dim] (the layers' `rope` index)
  const float* const* sin;
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
  // KV layer group 1 (windowed layers beside global ones: server/core/kv_groups.py), its own blocks
  const int64_t* slots_g1;         // [T]
  const int32_t* block_tables_g1;  // [T, bt_stride_g1]
  int64_t bt_stride_g1;
  // MoE layers' scratch (null when no layer is MoE)
  float* router_logits;  // [T, E]
  int64_t* expert_ids;   // [T, top_k]
  float* expert_weights; // [T, top_k]
  // a shared expert's output [T, H] (null when no layer has one); its gate / up and activation rows use
  // gate_up and act, which the caller sizes for max(I, S)
  float* shared_out;
};

// Router logits -> each row's top_k experts and weights, as server/models/moe/routing.py's select_experts.
// Top-k: the largest values in descending order, exact ties to the lowest index. torch.topk on CPU does not
// promise an order among equal values (tests/moe/test_moe_decode_graph.py saw it take 6 before 5 and
// [12, 3, 9] for three equal values), so on an exact tie at the top-k boundary the two paths may choose
// differently; random weights make such ties vanishingly rare (duplicated router rows make them).
// The softmax is max-subtracted in fp32; exp is libm's, so weights agree with torch's to fp32 rounding.
static void moe_route(const KiDecodeMoe& r, float* logits, int64_t t, int64_t* ids, float* weights) {
  const int64_t E = r.num_experts, K = r.top_k;
  for (int64_t row = 0; row < t; ++row) {
    float* lg = logits + row * E;
    int64_t* id = ids + row * K;
    float* w = weights + row * K;
    if (r.routing == 0) {  // probabilities over all experts first
      float mx = lg[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, lg[e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        lg[e] = std::exp(lg[e] - mx);
        sum += lg[e];
      }
      for (int64_t e = 0; e < E; ++e) lg[e] /= sum;
    }
    for (int64_t k = 0; k < K; ++k) {  // selection: strict > keeps the lowest index among equal values
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken = taken || id[j] == e;
        if (!taken && (best < 0 || lg[e] > lg[best])) best = e;
      }
      id[k] = best;
      w[k] = lg[best];
    }
    if (r.routing == 1) {  // softmax over the chosen logits (descending: w[0] is their max)
      const float mx = w[0];  // read before the loop overwrites w[0]
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        w[k] = std::exp(w[k] - mx);
        sum += w[k];
      }
      for (int64_t k = 0; k < K; ++k) w[k] /= sum;
    } else if (r.renormalize) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += w[k];
      for (int64_t k = 0; k < K; ++k) w[k] /= sum;
    }
  }
}

// The router of T rows (kubeinfer_moe_route, also the tests' entry point): x [T, H] fp32 rows x_stride
// apart; logits [T, E] (overwritten: after routing 0, the probabilities); ids [T, top_k] int64, weights
// [T, top_k] fp32. The router is a plain fp32 GEMV ([E, H] is small: 16 x 2048 on the Qwen3-MoE-2.1B shape),
// one dot product per (token, expert), summed in another order than torch's F.linear: logits agree to
// fp32 rounding, not bit for bit. Returns 1 for bad sizes.
int32_t kubeinfer_moe_route(const KiDecodeMoe* r, const float* x, int64_t t, int64_t x_stride, int64_t hidden,
                            float* logits, int64_t* ids, float* weights, int32_t threads) {
  const int64_t E = r->num_experts, H = hidden;
  if (t < 0 || H < 1 || x_stride < H || E < 1 || r->top_k < 1 || r->top_k > E || !r->router) return 1;
#pragma omp parallel for num_threads(threads) if (t * E * H >= 4 * kParallelMin)
  for (int64_t i = 0; i < t * E; ++i) {
    const float* xr = x + (i / E) * x_stride;
    const float* wr = r->router + (i % E) * H;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < H; ++c) dot += xr[c] * wr[c];
    logits[i] = dot + (r->router_bias ? r->router_bias[i % E] : 0.0f);
  }
  moe_route(*r, logits, t, ids, weights);
  return 0;
}

// The MoE MLP of T rows: x [T, H] -> out [T, H], the router then the experts' one call.
static int32_t moe_mlp(const KiDecodeModel* m, const KiDecodeStep* s, const KiDecodeMoe& r, const float* x,
                       float* out) {
  if (!m->moe_experts || !s->router_logits || !s->expert_ids || !s->expert_weights) return 1;
  int32_t rc = kubeinfer_moe_route(&r, x, s->t, m->hidden, m->hidden, s->router_logits, s->expert_ids,
                                   s->expert_weights, s->threads);
  if (rc) return rc;
  rc = m->moe_experts(r.experts, x, s->t, m->hidden, s->expert_ids, s->expert_weights, r.top_k, out, s->threads);
  if (rc) return 10 + rc;
  if (!r.shared_gate_up) return 0;
  const int64_t t = s->t, H = m->hidden, S = r.shared_inter;
  const int32_t nt = s->threads;
  if (!r.shared_down || !r.shared_gate || !s->shared_out || S < 1) return 2;
  if ((rc = m->qlinear(r.shared_gate_up, x, t, H, nullptr, s->gate_up, 2 * S, nt))) return 30 + rc;
  if ((rc = kubeinfer_silu_mul(s->gate_up, 2 * S, s->act, S, t, S, nt))) return 40 + rc;
  if ((rc = m->qlinear(r.shared_down, s->act, t, S, nullptr, s->shared_out, H, nt))) return 50 + rc;
  // out += sigmoid(x . gate) * shared, as FusedMoE: the gate's dot product in another order than F.linear's
  for (int64_t row = 0; row < t; ++row) {
    const float* xr = x + row * H;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < H; ++c) dot += xr[c] * r.shared_gate[c];
    const float g = 1.0f / (1.0f + std::exp(-dot));
    float* o = out + row * H;
    const float* so = s->shared_out + row * H;
#pragma omp simd
    for (int64_t c = 0; c < H; ++c) o[c] += g * so[c];
  }
  return 0;
}

// The residual add still owed by the previous sub-block (its output in `delta`, its post-norm, its multiplier).
struct Pending {
  float* delta;
  const float* post;
  float post_eps;
  float mult;
};

int32_t kubeinfer_decode_forward(const KiDecodeModel* m, const KiDecodeStep* s) {
  const int64_t t = s->t, H = m->hidden, I = m->inter, D = m->d;
  const int64_t q_width = (m->hq + 2 * m->hkv) * D, kv_width = m->hkv * D, o_width = m->hq * D;
  const int32_t nt = s->threads;
  int32_t rc;
  Pending p{nullptr, nullptr, 0.0f, 1.0f};
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const KiDecodeLayer& L = m->layers[l];
    if ((rc = kubeinfer_residual_norm(s->h, H, p.delta, H, p.post, p.post_eps, p.mult, L.attn_in_norm,
                                      L.attn_in_eps, s->x, H, t, H, nt)))
      return 100 + rc;
    const float* attn_in = L.attn_in_norm ? s->x : s->h;
    if ((rc = m->qlinear(L.qkv, attn_in, t, H, L.qkv_bias, s->qkv, q_width, nt))) return 200 + rc;
    if (L.k_proj) {  // q went into the first Hq D columns; k and v into theirs (row stride q_width)
      if ((rc = m->qlinear(L.k_proj, attn_in, t, H, L.k_bias, s->qkv + o_width, q_width, nt))) return 200 + rc;
      if ((rc = m->qlinear(L.v_proj, attn_in, t, H, L.v_bias, s->qkv + o_width + kv_width, q_width, nt)))
        return 200 + rc;
    }
    if (L.qk_norm == 1) {
      if ((rc = kubeinfer_head_rms_norm(s->qkv, q_width, t, m->hq, D, L.q_norm, L.qk_eps, nt))) return 1000 + rc;
      if ((rc = kubeinfer_head_rms_norm(s->qkv + o_width, q_width, t, m->hkv, D, L.k_norm, L.qk_eps, nt)))
        return 1100 + rc;
    } else if (L.qk_norm == 2) {
      if ((rc = kubeinfer_head_rms_norm(s->qkv, q_width, t, 1, o_width, L.q_norm, L.qk_eps, nt))) return 1000 + rc;
      if ((rc = kubeinfer_head_rms_norm(s->qkv + o_width, q_width, t, 1, kv_width, L.k_norm, L.qk_eps, nt)))
        return 1100 + rc;
    }
    if (L.rope >= 0 && (rc = kubeinfer_rotary(s->qkv, q_width, t, m->hq + m->hkv, D, L.rotary_dim,
                                              s->cos[L.rope], s->sin[L.rope], nt)))
      return 300 + rc;
    const bool g1 = L.kv_group == 1;
    const int64_t* slots = g1 ? s->slots_g1 : s->slots;
    const int32_t* tables = g1 ? s->block_tables_g1 : s->block_tables;
    const int64_t bt_stride = g1 ? s->bt_stride_g1 : s->bt_stride;
    if ((rc = m->kv_store(m->cache_dtype, L.k_cache, L.v_cache, slots, s->qkv + o_width,
                          s->qkv + o_width + kv_width, q_width, t, m->hkv, D, m->block_size)))
      return 1200 + rc;
    if ((rc = m->paged_decode(0, m->cache_dtype, s->attn, s->qkv, L.k_cache, L.v_cache, tables, s->context_lens,
                              s->seqs, s->seqs, t, q_width, o_width, bt_stride, m->hq, m->hkv, D, m->block_size,
                              L.scale, L.window, L.sinks, L.attn_softcap, nt)))
      return 400 + rc;
    if ((rc = m->qlinear(L.o, s->attn, t, o_width, L.o_bias, s->delta, H, nt))) return 500 + rc;
    if ((rc = kubeinfer_residual_norm(s->h, H, s->delta, H, L.attn_out_norm, L.attn_out_eps, L.residual_mult,
                                      L.mlp_in_norm, L.mlp_in_eps, s->x, H, t, H, nt)))
      return 600 + rc;
    const float* mlp_in = L.mlp_in_norm ? s->x : s->h;
    if (L.moe) {
      if ((rc = moe_mlp(m, s, *L.moe, mlp_in, s->delta))) return 1400 + rc;
      p = Pending{s->delta, L.mlp_out_norm, L.mlp_out_eps, L.residual_mult};
      continue;
    }
    if ((rc = m->qlinear(L.gate_up, mlp_in, t, H, L.gate_up_bias, s->gate_up, 2 * I, nt))) return 700 + rc;
    rc = L.activation == 1 ? kubeinfer_gelu_tanh_mul(s->gate_up, 2 * I, s->act, I, t, I, nt)
                           : kubeinfer_silu_mul(s->gate_up, 2 * I, s->act, I, t, I, nt);
    if (rc) return 800 + rc;
    if ((rc = m->qlinear(L.down, s->act, t, I, L.down_bias, s->delta, H, nt))) return 900 + rc;
    p = Pending{s->delta, L.mlp_out_norm, L.mlp_out_eps, L.residual_mult};
  }
  return kubeinfer_residual_norm(s->h, H, p.delta, H, p.post, p.post_eps, p.mult, m->final_norm, m->final_eps,
                                 s->out, H, t, H, nt);
}

}  // extern "C"
