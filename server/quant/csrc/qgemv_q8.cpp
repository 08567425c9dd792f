// Linear layers with int8 activations: y[M, N] = Q8(x)[M, K] @ W[N, K]^T (+ bias). Two kinds of call:
// - the GEMV, M <= 4 (one-user decode; KUBEINFER_INT8_GEMV, by default on only for bf16 and int8 layers on
//   CPUs with AVX512-VNNI or AVX2), on three code paths below; 32-value groups, or 8-bit values in 16-value
//   groups without min (Q6_K repacked: row_dot_g16);
// - the batched path, M > 4 (decode batches and prefill chunks; KUBEINFER_INT8_GEMM, on by default), for
//   4- or 8-bit weights in 32-blocks of layers whose descriptor asks for reduced precision (compute = bf16
//   or int8: `--dtype auto` on a CPU with native bf16, or without it: server/quant/gemm_dtype.py), on
//   AVX512-VNNI only: "batched" in the body below.
//
// llama.cpp's approach for its CPU GEMV (ggml-cpu's quantize_row_q8_0/q8_1 and ggml_vec_dot_q4_1_q8_1):
// each row of x is quantized per 32-block to int8 with one fp32 scale, d = max|x_b| / 127,
// q = round-to-nearest-even(x / d) (as x * (1 / d), fp32), and every block's dot product with the
// weight runs on integers, then is scaled once. Weights stay in our block layout (server/quant/
// cpu_qlinear.py, csrc/qlinear.cpp): 32-value groups, 4-bit nibbles in GGUF's order (byte j holds k = j
// low, k = j + 16 high) or int8 values, fp16 or fp32 scales, a zero point (Q4_0: 8) and optional mins
// (Q4_1, Q4_K repacked). Per block b of a row:
//   sum_k w_k x^_k = d_w (d_x dot(q_w, q_x)) + (min - zp d_w) (d_x sum(q_x))
// where x^ = d_x q_x is the activation as quantized: the result is exactly W @ x^ up to fp32
// rounding (cpu_qgemv_q8.linear_reference is the torch form of it).
//
// Three code paths, chosen at run time (kubeinfer_qgemv_q8_set_path, from server/cpu_features.py's
// usable features, never CPUID alone), each compiled into every x86-64 build with GCC's target pragma:
//   vnni    AVX512-VNNI `vpdpbusd` on 256-bit vectors (needs AVX512VL): u8 x s8 -> s32 in one op.
//           (On AMD Zen 4 a 512-bit op is two 256-bit halves: 256-bit vectors lose nothing there.)
//   avx2    `vpmaddubsw` + `vpmaddwd` (u8 x s8 pairs to s16, then s16 pairs to s32): no saturation,
//           |q_w| <= 15 or 128 times |q_x| <= 127, two products per s16.
//   scalar  plain C++, any CPU.
// The 8-bit weights (s8) go through the unsigned operand as |w| with x's sign flipped where w < 0.
// Anything else (other group sizes, batches it does not take, a kind of call switched off) goes to the
// fallback set by Python: qlinear.cpp's kubeinfer_qlinear, so that the decode graph can call this entry
// point for every projection.
//
// Batched path (AVX512-VNNI, 512-bit): per 16-column group of W, its 4-bit values (8-bit ones plus 128) are
// transposed into vectors of 16 columns x 4 consecutive k (u8), its scales and offsets into [block][16]
// fp32; x rows, quantized like the GEMV's, are interleaved 8 rows at a time; the micro-kernel runs 8
// vpdpbusd per block (64 products each, int32 lanes = columns) per row and scales each block's sums in
// fp32, the GEMV's formula. Without a packed copy the packing is per call (one 16-column group at a time,
// amortized over the rows), so the GGUF layout is the only copy; with one (kubeinfer_qgemv_q8_pack, made
// at load like llama.cpp's repacked weights for the same instruction: same bytes of W, one contiguous
// stream per group) a call reads it in order, in place for up to 64 rows (decode batches). Measured
// on a 2-core AMD EPYC (Zen 4, AVX-512): 1.3-1.9x qlinear's bf16 batched path at M = 8..255 with the
// weights in cache, 1.3-1.45x oneDNN's bf16 GEMM at M = 256..2048 (docs/benchmarks.md).
#ifndef KI_Q8_BODY
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KI_Q8_X86 1
#else
#define KI_Q8_X86 0
#endif

extern "C" {
struct KiQWeight {  // csrc/qlinear.cpp's descriptor, field for field
  const uint8_t* q;
  const void* scales;
  const void* mins;
  int64_t n, k, group_size, groups, row_bytes;
  int32_t bits, zero_point, scale_is_f16, compute;  // compute: read by the fallback only
  const uint8_t* packed;  // the batched path's copy of W (kubeinfer_qgemv_q8_pack), or null: packed per call
};
typedef int32_t (*KiQLinearFn)(const KiQWeight* w, const float* x, int64_t m, int64_t x_stride,
                               const float* bias, float* y, int64_t y_stride, int32_t nthreads);
}

namespace {

constexpr int64_t MAX_ROWS = 4;
constexpr int PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_VNNI = 2;

// One x row, quantized: q [K] int8, d [K / 32] block scales, s [K / 32] = d * sum(q) of each block.
struct QRow {
  const int8_t* q;
  const float* d;
  const float* s;
};

float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, subnormals included
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <bool F16>
inline float scale_at(const void* p, int64_t i) {
  if constexpr (F16) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

// Block b of x (32 floats) -> q, and returns d. The same arithmetic as every SIMD path and the torch
// reference: d = amax / 127, inv = 1 / d (0 for an all-zero block), q = nearbyint(x * inv).
float quantize_block_scalar(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
  return d;
}

template <int BITS>
inline int w_at(const uint8_t* row, int64_t k) {  // W's integer at k (before the zero point)
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(row[k]);
  } else {
    const uint8_t byte = row[(k / 32) * 16 + (k % 16)];
    return (k % 32) < 16 ? (byte & 0x0f) : (byte >> 4);
  }
}

namespace scalar_path {
// Not auto-vectorized: GCC 12 at -O3 with AVX512-VNNI turns this signed x signed byte dot product into
// vpdpbusd, which reads the first operand as unsigned (wrong for Q8_0's negative weights; seen here).
template <int BITS, bool F16>
__attribute__((optimize("no-tree-vectorize"))) float row_dot(const KiQWeight& w, int64_t n, const QRow& x) {
  const uint8_t* row = w.q + n * w.row_bytes;
  const float zp = static_cast<float>(w.zero_point);
  float acc = 0.0f;
  for (int64_t b = 0; b < w.k / 32; ++b) {
    int32_t dot = 0;
    for (int64_t j = 0; j < 32; ++j) dot += w_at<BITS>(row, b * 32 + j) * x.q[b * 32 + j];
    const float dw = scale_at<F16>(w.scales, n * w.groups + b);
    const float mn = w.mins ? scale_at<F16>(w.mins, n * w.groups + b) : 0.0f;
    acc += dw * (x.d[b] * static_cast<float>(dot)) + (mn - zp * dw) * x.s[b];
  }
  return acc;
}
// 8-bit W in 16-value groups (Q6_K repacked: q - 32 in [-32, 31], one fp32 scale per 16, no min): each
// half of x's 32-block is dotted on its own and scaled by its group's scale, then by the block's d_x.
template <bool F16>
__attribute__((optimize("no-tree-vectorize"))) float row_dot_g16(const KiQWeight& w, int64_t n, const QRow& x) {
  const int8_t* row = reinterpret_cast<const int8_t*>(w.q + n * w.row_bytes);
  float acc = 0.0f;
  for (int64_t b = 0; b < w.k / 32; ++b) {
    int32_t dot[2] = {0, 0};
    for (int64_t j = 0; j < 32; ++j) dot[j / 16] += row[b * 32 + j] * x.q[b * 32 + j];
    const float s0 = scale_at<F16>(w.scales, n * w.groups + 2 * b);
    const float s1 = scale_at<F16>(w.scales, n * w.groups + 2 * b + 1);
    acc += x.d[b] * (s0 * static_cast<float>(dot[0]) + s1 * static_cast<float>(dot[1]));
  }
  return acc;
}
float quantize_block(const float* x, int8_t* q) { return quantize_block_scalar(x, q); }
}  // namespace scalar_path

}  // namespace

// The SIMD paths: this file's body below, compiled twice under different target options.
#if KI_Q8_X86
#define KI_Q8_BODY 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KI_Q8_VNNI 0
namespace {
namespace avx2_path {
#include __FILE__
}
}  // namespace
#undef KI_Q8_VNNI
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define KI_Q8_VNNI 1
namespace {
namespace vnni_path {
#include __FILE__
}
}  // namespace
#undef KI_Q8_VNNI
#pragma GCC pop_options
#undef KI_Q8_BODY
#endif

namespace {

int path_in_use = PATH_SCALAR;
KiQLinearFn fallback = nullptr;

int best_compiled_path() {
#if KI_Q8_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw")) {
    return PATH_VNNI;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return PATH_AVX2;
#endif
  return PATH_SCALAR;
}

// Which calls this library takes (kubeinfer_qgemv_q8_set_modes): the GEMV (M <= MAX_ROWS), and the batched
// int8 path (M > MAX_ROWS, vnni only, 4- or 8-bit W, layers that allow reduced precision: compute bf16 or int8).
// gemv_fp32: the GEMV also takes layers computing in fp32 (KUBEINFER_INT8_GEMV=1 said so), not only those.
bool gemv_on = true, gemm_on = false, gemv_fp32 = true;
// qlinear.cpp's KI_COMPUTE_FP32: only this compute flag asks for fp32 activations; KI_COMPUTE_BF16 and
// KI_COMPUTE_INT8 (gemm_dtype bf16 or int8) allow reduced precision.
constexpr int32_t COMPUTE_FP32 = 0;

bool gemm_supported(const KiQWeight* w, int64_t m) {
  if (!gemm_on || path_in_use != PATH_VNNI || !w || !w->q || !w->scales || w->n < 0) return false;
  if (m <= MAX_ROWS || w->compute == COMPUTE_FP32 || (w->bits != 4 && w->bits != 8)) return false;
  return w->k >= 32 && w->k % 32 == 0 && w->group_size == 32 && w->groups == w->k / 32 &&
         w->row_bytes == w->k * w->bits / 8;
}

// 8-bit values in 16-value groups with neither zero point nor min: Q6_K as the loader repacks it.
bool is_g16(const KiQWeight* w) {
  return w->bits == 8 && w->group_size == 16 && w->k >= 32 && w->k % 32 == 0 && w->groups == w->k / 16 &&
         w->row_bytes == w->k && !w->mins && w->zero_point == 0;
}

bool supported(const KiQWeight* w, int64_t m) {
  if (gemm_supported(w, m)) return true;
  if (!gemv_on || !w || !w->q || !w->scales || w->n < 0 || m < 1 || m > MAX_ROWS) return false;
  if (!gemv_fp32 && w->compute == COMPUTE_FP32) return false;
  if (is_g16(w)) return true;
  if (w->k < 32 || w->k % 32 || w->group_size != 32 || w->groups != w->k / 32) return false;
  if (w->bits == 4) return w->row_bytes == w->k / 2;
  if (w->bits == 8) return w->row_bytes == w->k;
  return false;
}

template <int BITS, bool F16, typename Dot>
void run_span(const KiQWeight& w, const QRow* xs, int64_t m, int64_t n0, int64_t n1, const float* bias, float* y,
              int64_t y_stride, Dot dot) {
  for (int64_t n = n0; n < n1; ++n) {  // a row of W (<= 768 bytes at K = 1536) stays in L1 across x rows
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t i = 0; i < m; ++i) y[i * y_stride + n] = dot(w, n, xs[i]) + b;
  }
}

// BITS 16 below: 8-bit W in 16-value groups (is_g16), row_dot_g16.
template <int BITS, bool F16>
void q8_gemv(const KiQWeight& w, const float* x, int64_t m, int64_t x_stride, const float* bias, float* y,
             int64_t y_stride, int nthreads) {
  const int64_t K = w.k, nb = K / 32, N = w.n;
  std::vector<int8_t> q(static_cast<size_t>(m * K));
  std::vector<float> ds(static_cast<size_t>(2 * m * nb));
  QRow rows[MAX_ROWS];
  const int path = path_in_use;
  for (int64_t i = 0; i < m; ++i) {  // K <= a few thousand values: not worth a parallel region
    int8_t* qi = q.data() + i * K;
    float *d = ds.data() + 2 * i * nb, *s = d + nb;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * x_stride + b * 32;
      int8_t* qb = qi + b * 32;
#if KI_Q8_X86
      d[b] = path == PATH_VNNI   ? vnni_path::quantize_block(xb, qb)
             : path == PATH_AVX2 ? avx2_path::quantize_block(xb, qb)
                                 : scalar_path::quantize_block(xb, qb);
#else
      d[b] = scalar_path::quantize_block(xb, qb);
#endif
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) sum += qb[j];
      s[b] = d[b] * static_cast<float>(sum);
    }
    rows[i] = QRow{qi, d, s};
  }
  auto run = [&](auto dot) {
    if (m == 1) {  // one contiguous span of W per thread, each weight read once
#pragma omp parallel num_threads(nthreads)
      {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        run_span<BITS, F16>(w, rows, m, N * t / T, N * (t + 1) / T, bias, y, y_stride, dot);
      }
    } else {
      constexpr int64_t CHUNK = 32;
#pragma omp parallel for schedule(static) num_threads(nthreads)
      for (int64_t c = 0; c < (N + CHUNK - 1) / CHUNK; ++c) {
        run_span<BITS, F16>(w, rows, m, c * CHUNK, std::min(N, (c + 1) * CHUNK), bias, y, y_stride, dot);
      }
    }
  };
  if constexpr (BITS == 16) {
#if KI_Q8_X86
    if (path == PATH_VNNI) return run(vnni_path::row_dot_g16<F16>);
    if (path == PATH_AVX2) return run(avx2_path::row_dot_g16<F16>);
#endif
    run(scalar_path::row_dot_g16<F16>);
  } else {
#if KI_Q8_X86
    if (path == PATH_VNNI) return run(vnni_path::row_dot<BITS, F16>);
    if (path == PATH_AVX2) return run(avx2_path::row_dot<BITS, F16>);
#endif
    run(scalar_path::row_dot<BITS, F16>);
  }
}

}  // namespace

extern "C" {

int32_t kubeinfer_qgemv_q8_abi() { return 6; }

// Which calls this library takes: gemv (M <= 4; for descriptors asking for fp32 compute too only where
// gemv_fp32_layers) and gemm (the batched int8 path, M > 4: vnni, 4- or 8-bit W in 32-blocks, descriptors
// asking for bf16 or int8 compute); the rest goes to the fallback. Set by Python before each layer's call (the
// same values unless a switch changed), never while a kernel runs: not synchronized.
void kubeinfer_qgemv_q8_set_modes(int32_t gemv, int32_t gemm, int32_t gemv_fp32_layers) {
  gemv_on = gemv != 0;
  gemm_on = gemm != 0;
  gemv_fp32 = gemv_fp32_layers != 0;
}

// The path to run: 2 vnni, 1 avx2, 0 scalar; lowered to what this CPU reports (libgcc's CPUID check, a
// second guard behind Python's OS-enabled features). Returns the path now in use. Set at load, not
// thread-safe against running kernels.
int32_t kubeinfer_qgemv_q8_set_path(int32_t path) {
  path_in_use = std::clamp(path, PATH_SCALAR, best_compiled_path());
  return path_in_use;
}

// What serves the calls this kernel does not take (qlinear.cpp's kubeinfer_qlinear); null: they fail.
void kubeinfer_qgemv_q8_set_fallback(KiQLinearFn fn) { fallback = fn; }

// 1 when `w` with `m` rows of x takes the int8 path (else the fallback serves the call).
int32_t kubeinfer_qgemv_q8_supports(const KiQWeight* w, int64_t m) { return supported(w, m) ? 1 : 0; }

// Bytes of the batched path's packed copy of `w` (kubeinfer_qgemv_q8_pack), 0 when the batched path
// cannot take `w` (not 4- or 8-bit in 32-blocks) or this CPU runs another path.
int64_t kubeinfer_qgemv_q8_packed_bytes(const KiQWeight* w) {
  if (path_in_use != PATH_VNNI || !w || !w->q || !w->scales || w->n <= 0 || (w->bits != 4 && w->bits != 8)) return 0;
  if (w->k < 32 || w->k % 32 || w->group_size != 32 || w->groups != w->k / 32 || w->row_bytes != w->k * w->bits / 8)
    return 0;
#if KI_Q8_X86
  const int64_t per = w->bits == 4 ? vnni_path::PACK_BLOCK<4> : vnni_path::PACK_BLOCK<8>;
  return (w->n + 15) / 16 * (w->k / 32) * per;
#else
  return 0;
#endif
}

// Writes the packed copy of `w` (kubeinfer_qgemv_q8_packed_bytes(w) bytes, 64-byte aligned) to `out`;
// the batched path reads it where a descriptor's `packed` points to it. Returns 0, or 3 when
// kubeinfer_qgemv_q8_packed_bytes is 0.
int32_t kubeinfer_qgemv_q8_pack(const KiQWeight* w, uint8_t* out, int32_t nthreads) {
  if (kubeinfer_qgemv_q8_packed_bytes(w) == 0 || !out) return 3;
#if KI_Q8_X86
  const int nt = std::max(nthreads, 1);
  if (w->bits == 4) {
    w->scale_is_f16 ? vnni_path::pack_weight<4, true>(*w, out, nt) : vnni_path::pack_weight<4, false>(*w, out, nt);
  } else {
    w->scale_is_f16 ? vnni_path::pack_weight<8, true>(*w, out, nt) : vnni_path::pack_weight<8, false>(*w, out, nt);
  }
  return 0;
#else
  return 3;
#endif
}

// y[i * y_stride + n] = sum_k Q8(x)[i, k] W[n, k] (+ bias[n]) for i < m, n < w->n: qlinear's signature.
// Returns 0, or 3 for a call it does not take without a fallback, or the fallback's code.
int32_t kubeinfer_qgemv_q8(const KiQWeight* w, const float* x, int64_t m, int64_t x_stride, const float* bias,
                           float* y, int64_t y_stride, int32_t nthreads) {
  if (!supported(w, m)) return fallback ? fallback(w, x, m, x_stride, bias, y, y_stride, nthreads) : 3;
  const int nt = std::max(nthreads, 1);
#if KI_Q8_X86
  if (m > MAX_ROWS) {  // supported(): the batched path
    if (w->bits == 4) {
      w->scale_is_f16 ? vnni_path::gemm_q8<4, true>(*w, x, m, x_stride, bias, y, y_stride, nt)
                      : vnni_path::gemm_q8<4, false>(*w, x, m, x_stride, bias, y, y_stride, nt);
    } else {
      w->scale_is_f16 ? vnni_path::gemm_q8<8, true>(*w, x, m, x_stride, bias, y, y_stride, nt)
                      : vnni_path::gemm_q8<8, false>(*w, x, m, x_stride, bias, y, y_stride, nt);
    }
    return 0;
  }
#endif
  if (is_g16(w)) {
    w->scale_is_f16 ? q8_gemv<16, true>(*w, x, m, x_stride, bias, y, y_stride, nt)
                    : q8_gemv<16, false>(*w, x, m, x_stride, bias, y, y_stride, nt);
  } else if (w->bits == 4) {
    w->scale_is_f16 ? q8_gemv<4, true>(*w, x, m, x_stride, bias, y, y_stride, nt)
                    : q8_gemv<4, false>(*w, x, m, x_stride, bias, y, y_stride, nt);
  } else {
    w->scale_is_f16 ? q8_gemv<8, true>(*w, x, m, x_stride, bias, y, y_stride, nt)
                    : q8_gemv<8, false>(*w, x, m, x_stride, bias, y, y_stride, nt);
  }
  return 0;
}
}

#else  // KI_Q8_BODY: one SIMD path (namespace and target options set by the includer)

// Block b of x -> q (int8) and its scale d: the scalar arithmetic, eight lanes at a time.
inline float quantize_block(const float* x, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = _mm_cvtss_f32(h) / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i r[4];  // cvtps rounds to nearest even (the default MXCSR mode), as nearbyint does
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
  // packs work within 128-bit lanes: [0..3 8..11 4..7 12..15] per pair, fixed by the permute.
  const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  const __m256i fixed = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), fixed);
  return d;
}

// dot(q_w, q_x) of one 32-block in 8 s32 lanes.
template <int BITS>
inline __m256i block_dot(const uint8_t* wp, const int8_t* xp) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
  __m256i u, s;
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp));
    u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
    s = xv;
  } else {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    u = _mm256_abs_epi8(wv);
    s = _mm256_sign_epi8(xv, wv);
  }
#if KI_Q8_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// [sum(v0), ..., sum(v7)] of eight s32 vectors.
inline __m256i hsum8(const __m256i v[8]) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

template <bool F16>
inline __m256 load8(const void* p, int64_t i) {
  if constexpr (F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row n of W against one quantized x row: eight blocks at a time, their integer dots reduced into one
// vector and scaled by eight loaded scales (a broadcast per block would cost as much as the dot).
template <int BITS, bool F16>
float row_dot(const KiQWeight& w, int64_t n, const QRow& x) {
  constexpr int64_t BB = BITS == 4 ? 16 : 32;  // bytes of W per block
  const int64_t nb = w.k / 32, base = n * w.groups;
  const uint8_t* row = w.q + n * w.row_bytes;
  const bool offset = w.mins || w.zero_point;
  const __m256 zp = _mm256_set1_ps(static_cast<float>(w.zero_point));
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256i p[8];
    for (int i = 0; i < 8; ++i) p[i] = block_dot<BITS>(row + (b + i) * BB, x.q + (b + i) * 32);
    const __m256 dot = _mm256_cvtepi32_ps(hsum8(p));
    const __m256 dw = load8<F16>(w.scales, base + b);
    acc = _mm256_fmadd_ps(dw, _mm256_mul_ps(_mm256_loadu_ps(x.d + b), dot), acc);
    if (offset) {
      __m256 off = _mm256_mul_ps(zp, dw);
      off = w.mins ? _mm256_sub_ps(load8<F16>(w.mins, base + b), off) : _mm256_sub_ps(_mm256_setzero_ps(), off);
      acc = _mm256_fmadd_ps(off, _mm256_loadu_ps(x.s + b), acc);
    }
  }
  float tail = 0.0f;
  for (; b < nb; ++b) {
    const __m256i p = block_dot<BITS>(row + b * BB, x.q + b * 32);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    const float dw = scale_at<F16>(w.scales, base + b);
    const float mn = w.mins ? scale_at<F16>(w.mins, base + b) : 0.0f;
    tail += dw * (x.d[b] * static_cast<float>(_mm_cvtsi128_si32(s)));
    if (offset) tail += (mn - static_cast<float>(w.zero_point) * dw) * x.s[b];
  }
  return hsum_ps(acc) + tail;
}

// 8-bit W in 16-value groups (is_g16): four blocks at a time. hadd twice turns the four blocks' s32 lanes
// into [first-half sums of blocks 0..3 | second-half sums of blocks 0..3] (lanes 0-3 of a block's dot are
// its k < 16, lanes 4-7 its k >= 16); the eight group scales, stored [b0 g0, b0 g1, b1 g0, ...], are
// permuted into that order and x's four block scales repeated in both halves.
template <bool F16>
float row_dot_g16(const KiQWeight& w, int64_t n, const QRow& x) {
  const int64_t nb = w.k / 32, base = n * w.groups;
  const uint8_t* row = w.q + n * w.row_bytes;
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    __m256i p[4];
    for (int i = 0; i < 4; ++i) p[i] = block_dot<8>(row + (b + i) * 32, x.q + (b + i) * 32);
    const __m256i halves = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256 sw = _mm256_permutevar8x32_ps(load8<F16>(w.scales, base + 2 * b), order);
    const __m256 dx = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x.d + b));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(sw, dx), _mm256_cvtepi32_ps(halves), acc);
  }
  float tail = 0.0f;
  for (; b < nb; ++b) {
    const __m256i p = block_dot<8>(row + b * 32, x.q + b * 32);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), p);
    const float s0 = scale_at<F16>(w.scales, base + 2 * b), s1 = scale_at<F16>(w.scales, base + 2 * b + 1);
    tail += x.d[b] * (s0 * static_cast<float>(lanes[0] + lanes[1] + lanes[2] + lanes[3]) +
                      s1 * static_cast<float>(lanes[4] + lanes[5] + lanes[6] + lanes[7]));
  }
  return hsum_ps(acc) + tail;
}

#if KI_Q8_VNNI
// ---------------------------------------------------------------- batched: 4/8-bit W, 16 columns at a time
// For M > MAX_ROWS rows of x (a decode batch) and 4- or 8-bit weights in 32-blocks. Per 16-column group of W
// (4-bit; 8-bit W: the block's 32 bytes as two 16-byte halves, each value + 128, see pack_group):
//   pack: each block's 16 nibble bytes per column, as four dwords D[c][j] (bytes 4j..4j+3: k = 4j..4j+3 in
//     the low nibbles, k = 16 + 4j.. in the high ones), transposed so that one vector holds dword j of all
//     16 columns (wq[(b * 8 + q) * 16 + c], q < 4 low nibbles of D[c][q], q >= 4 high nibbles of D[c][q-4]:
//     four u8 weights k = 4q.. of column c), and the group's scales d and offsets (min - zp d) per block
//     gathered as [nb][16] floats;
//   micro-kernel: up to 8 rows of x at once; per block 8 vpdpbusd (u8 W x s8 x, 64 products each) into
//     s32 lanes = columns, then y += d_w d_x dot + off_w s_x in fp32 (the GEMV's block formula).
// Bit-for-bit it is not the GEMV (other fp32 summation order); both are W @ x^ up to fp32 rounding.
constexpr int GROUP = 16;

// Rows c < cols of a [*, stride_bytes] array, 16 bytes each from `base + c * stride_bytes` (zero for c >=
// cols) -> d[j] holding dword j of all 16 rows (d[j] lane i = dword j of row i). Z_r takes rows r, 4 + r,
// 8 + r, 12 + r in its four 128-bit lanes; a 4x4 dword transpose inside each lane then leaves row 4L + r at
// dword r of lane L, i.e. the rows in order.
inline void transpose16x4(const uint8_t* base, int64_t stride_bytes, int cols, __m512i d[4]) {
  __m512i z[4];
  for (int r = 0; r < 4; ++r) {
    z[r] = _mm512_setzero_si512();
    for (int L = 0; L < 4; ++L) {
      const int c = 4 * L + r;
      if (c < cols) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + c * stride_bytes));
        z[r] = _mm512_inserti32x4(z[r], v, L);
      }
    }
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  d[0] = _mm512_unpacklo_epi64(t0, t2);
  d[1] = _mm512_unpackhi_epi64(t0, t2);
  d[2] = _mm512_unpacklo_epi64(t1, t3);
  d[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The [n, groups] scales (or mins) of columns [n0, n0 + cols) -> out[b * 16 + c] fp32, b < nb.
template <bool F16>
inline void gather_scales(const void* p, int64_t groups, int64_t n0, int cols, int64_t nb, float* out) {
  constexpr int ES = F16 ? 2 : 4, PER = 16 / ES;  // bytes per scale, blocks per 16-byte row piece
  const auto* base = static_cast<const uint8_t*>(p) + n0 * groups * ES;
  int64_t b0 = 0;
  for (; b0 + PER <= nb; b0 += PER) {
    __m512i d[4];
    transpose16x4(base + b0 * ES, groups * ES, cols, d);
    for (int j = 0; j < 4; ++j) {
      if constexpr (F16) {  // dword j = blocks b0 + 2j (low half) and b0 + 2j + 1 (high half)
        _mm512_storeu_ps(out + (b0 + 2 * j) * GROUP, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d[j])));
        _mm512_storeu_ps(out + (b0 + 2 * j + 1) * GROUP,
                         _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(d[j], 16))));
      } else {
        _mm512_storeu_ps(out + (b0 + j) * GROUP, _mm512_castsi512_ps(d[j]));
      }
    }
  }
  for (; b0 < nb; ++b0) {
    for (int c = 0; c < GROUP; ++c) {
      float v = 0.0f;
      if (c < cols) {
        const int64_t i = (n0 + c) * groups + b0;
        v = F16 ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
      }
      out[b0 * GROUP + c] = v;
    }
  }
}

// Column group [n0, n0 + cols) of W, cols <= 16 (missing columns zero) -> wq [nb * 8 * 16] u8x4 (vector
// (b, q) holds k = 32 b + 4q.. of every column), dw and off [nb * 16] fp32 (d and min - zp d). 8-bit W
// (s8) goes in as w + 128 (u8, vpdpbusd's unsigned operand) with 128 added to its zero point: the same
// block formula (the integer dot is exact in int32; the + 128 is taken back in fp32 by the offset term,
// an fp32 rounding far below the activations' int8 rounding).
template <int BITS, bool F16>
inline void pack_group(const KiQWeight& w, int64_t n0, int cols, uint32_t* wq, float* dw, float* off) {
  const int64_t nb = w.k / 32;
  const __m512i lo = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    uint32_t* dst = wq + b * 8 * GROUP;
    if constexpr (BITS == 4) {
      __m512i d[4];  // dword j of a block's 16 bytes: k = 4j.. in the low nibbles, k = 16 + 4j.. in the high
      transpose16x4(w.q + n0 * w.row_bytes + b * 16, w.row_bytes, cols, d);
      for (int j = 0; j < 4; ++j) {
        _mm512_storeu_si512(dst + j * GROUP, _mm512_and_si512(d[j], lo));
        _mm512_storeu_si512(dst + (j + 4) * GROUP, _mm512_and_si512(_mm512_srli_epi16(d[j], 4), lo));
      }
    } else {  // a block's 32 bytes: k = 0..15, then k = 16..31
      for (int h = 0; h < 2; ++h) {
        __m512i d[4];
        transpose16x4(w.q + n0 * w.row_bytes + b * 32 + h * 16, w.row_bytes, cols, d);
        for (int j = 0; j < 4; ++j) _mm512_storeu_si512(dst + (4 * h + j) * GROUP, _mm512_xor_si512(d[j], flip));
      }
    }
  }
  gather_scales<F16>(w.scales, w.groups, n0, cols, nb, dw);
  const __m512 zp = _mm512_set1_ps(static_cast<float>(w.zero_point + (BITS == 8 ? 128 : 0)));
  if (w.mins) gather_scales<F16>(w.mins, w.groups, n0, cols, nb, off);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 mv = w.mins ? _mm512_loadu_ps(off + b * GROUP) : _mm512_setzero_ps();
    _mm512_storeu_ps(off + b * GROUP, _mm512_fnmadd_ps(zp, _mm512_loadu_ps(dw + b * GROUP), mv));
  }
}

// The packed copy (kubeinfer_qgemv_q8_pack): per 16-column group, per block b, PACK_W bytes of W as
// transpose16x4 leaves them (4-bit: the four dwords of raw nibble bytes; 8-bit: eight dword vectors, + 128)
// then dw[16] and off[16] fp32 (pack_group's values): one contiguous stream per group, read in order,
// instead of 16 strided rows, transposes and scale gathers on every call. Same bytes of W, scales in fp32.
template <int BITS>
constexpr int64_t PACK_W = BITS == 4 ? 4 * 64 : 8 * 64;
template <int BITS>
constexpr int64_t PACK_BLOCK = PACK_W<BITS> + 2 * GROUP * 4;

template <int BITS, bool F16>
void pack_weight(const KiQWeight& w, uint8_t* out, int nthreads) {
  const int64_t nb = w.k / 32, groups = (w.n + GROUP - 1) / GROUP;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<uint32_t> wq(static_cast<size_t>(nb * 8 * GROUP));
    std::vector<float> dw(static_cast<size_t>(nb * GROUP)), off(static_cast<size_t>(nb * GROUP));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n0 = g * GROUP;
      const int cols = static_cast<int>(std::min<int64_t>(GROUP, w.n - n0));
      pack_group<BITS, F16>(w, n0, cols, wq.data(), dw.data(), off.data());
      uint8_t* dst = out + g * nb * PACK_BLOCK<BITS>;
      for (int64_t b = 0; b < nb; ++b, dst += PACK_BLOCK<BITS>) {
        const uint32_t* src = wq.data() + b * 8 * GROUP;
        if constexpr (BITS == 4) {  // low nibbles (q < 4) | high nibbles (q >= 4) << 4: the raw bytes again
          for (int j = 0; j < 4; ++j) {
            const __m512i lo = _mm512_loadu_si512(src + j * GROUP), hi = _mm512_loadu_si512(src + (j + 4) * GROUP);
            _mm512_storeu_si512(dst + j * 64, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
          }
        } else {
          std::memcpy(dst, src, PACK_W<BITS>);
        }
        std::memcpy(dst + PACK_W<BITS>, dw.data() + b * GROUP, GROUP * 4);
        std::memcpy(dst + PACK_W<BITS> + GROUP * 4, off.data() + b * GROUP, GROUP * 4);
      }
    }
  }
}

// pack_group's output for group g, read from the packed copy.
template <int BITS>
inline void unpack_group(const uint8_t* packed, int64_t g, int64_t nb, uint32_t* wq, float* dw, float* off) {
  const uint8_t* src = packed + g * nb * PACK_BLOCK<BITS>;
  const __m512i lo = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b, src += PACK_BLOCK<BITS>) {
    uint32_t* dst = wq + b * 8 * GROUP;
    if constexpr (BITS == 4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(src + j * 64);
        _mm512_storeu_si512(dst + j * GROUP, _mm512_and_si512(v, lo));
        _mm512_storeu_si512(dst + (j + 4) * GROUP, _mm512_and_si512(_mm512_srli_epi16(v, 4), lo));
      }
    } else {
      for (int j = 0; j < 8; ++j) _mm512_storeu_si512(dst + j * GROUP, _mm512_loadu_si512(src + j * 64));
    }
    _mm512_storeu_ps(dw + b * GROUP, _mm512_loadu_ps(reinterpret_cast<const float*>(src + PACK_W<BITS>)));
    _mm512_storeu_ps(off + b * GROUP, _mm512_loadu_ps(reinterpret_cast<const float*>(src + PACK_W<BITS> + GROUP * 4)));
  }
}

// acc + dpbusd(w, the dword at q broadcast), the broadcast as vpdpbusd's own {1to16} memory operand: GCC 12
// emits a vpbroadcastd for _mm512_set1_epi32(*q) instead, an extra op for each product here (as in
// qk_native.cpp's Avx512::dpbusd_at).
inline __m512i dpbusd_at(__m512i acc, __m512i w, const int32_t* q) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*q));
  return acc;
}

// acc[r] (16 columns) += rows r0 + r of the row block, r < R; xp: the block's quantized x interleaved,
// xp[(b * 8 + q) * R + r] = the four int8 values k = 32 b + 4q.. of row r0 + r; xd, xs: [nb * R].
template <int R>
inline void micro_q8(const uint32_t* wq, const float* dw, const float* off, int64_t nb, const int32_t* xp,
                     const float* xd, const float* xs, __m512 acc[]) {
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ai[R];
    for (int r = 0; r < R; ++r) ai[r] = _mm512_setzero_si512();
    const uint32_t* wb = wq + b * 8 * GROUP;
    const int32_t* xb = xp + b * 8 * R;
    for (int q = 0; q < 8; ++q) {
      const __m512i wv = _mm512_loadu_si512(wb + q * GROUP);
      for (int r = 0; r < R; ++r) ai[r] = dpbusd_at(ai[r], wv, xb + q * R + r);
    }
    const __m512 dwb = _mm512_loadu_ps(dw + b * GROUP), offb = _mm512_loadu_ps(off + b * GROUP);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r]), _mm512_mul_ps(dwb, _mm512_set1_ps(xd[b * R + r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(offb, _mm512_set1_ps(xs[b * R + r]), acc[r]);
    }
  }
}

// micro_q8 reading W straight from the packed copy (blocks PACK_BLOCK apart, 4-bit nibbles split in
// registers): for the few row blocks of a decode batch, where unpacking a group into wq first would cost
// more than it saves.
template <int BITS, int R>
inline void micro_q8_packed(const uint8_t* src, int64_t nb, const int32_t* xp, const float* xd, const float* xs,
                            __m512 acc[]) {
  const __m512i lo = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b, src += PACK_BLOCK<BITS>) {
    __m512i ai[R];
    for (int r = 0; r < R; ++r) ai[r] = _mm512_setzero_si512();
    const int32_t* xb = xp + b * 8 * R;
    for (int q = 0; q < 8; ++q) {
      __m512i wv;
      if constexpr (BITS == 4) {
        const __m512i v = _mm512_loadu_si512(src + (q & 3) * 64);
        wv = q < 4 ? _mm512_and_si512(v, lo) : _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
      } else {
        wv = _mm512_loadu_si512(src + q * 64);
      }
      for (int r = 0; r < R; ++r) ai[r] = dpbusd_at(ai[r], wv, xb + q * R + r);
    }
    const __m512 dwb = _mm512_loadu_ps(reinterpret_cast<const float*>(src + PACK_W<BITS>));
    const __m512 offb = _mm512_loadu_ps(reinterpret_cast<const float*>(src + PACK_W<BITS> + GROUP * 4));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r]), _mm512_mul_ps(dwb, _mm512_set1_ps(xd[b * R + r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(offb, _mm512_set1_ps(xs[b * R + r]), acc[r]);
    }
  }
}

template <int BITS, int R>
inline void rows_q8_packed(const uint8_t* src, int64_t nb, const int32_t* xp, const float* xd, const float* xs,
                           int64_t r0, int64_t n0, int cols, const float* bias, float* y, int64_t y_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  micro_q8_packed<BITS, R>(src, nb, xp, xd, xs, acc);
  const __mmask16 colmask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(colmask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * y_stride + n0, colmask, _mm512_add_ps(acc[r], bv));
}

template <int R>
inline void rows_q8(const uint32_t* wq, const float* dw, const float* off, int64_t nb, const int32_t* xp,
                    const float* xd, const float* xs, int64_t r0, int64_t n0, int cols, const float* bias, float* y,
                    int64_t y_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  micro_q8<R>(wq, dw, off, nb, xp, xd, xs, acc);
  const __mmask16 colmask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(colmask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * y_stride + n0, colmask, _mm512_add_ps(acc[r], bv));
}

constexpr int RB = 8;             // rows of x per micro-kernel call
constexpr int64_t ROW_CHUNK = 256;  // rows per pass over W: their interleaved x stays in L2 (K <= ~4096)
// With a packed W, passes of at most this many row blocks (64 rows) read it in place (micro_q8_packed):
// 1.05-1.45x faster than unpacking each group into wq first at 8-64 rows, alike at 128 (Zen 4 EPYC,
// docs/benchmarks.md).
constexpr int64_t DIRECT_MAX_BLOCKS = 8;

// Rows [r0, r0 + R) of x, R <= RB, quantized per 32-block (quantize_block) into the micro-kernel's layout:
// xp[(b * 8 + q) * R + r] = the four int8 values k = 32 b + 4q.. of row r0 + r; xd[b * R + r] = its scale d,
// xs[b * R + r] = d * sum(q) of the block.
inline void quantize_rows(const float* x, int64_t x_stride, int64_t r0, int64_t R, int64_t K, int32_t* xp, float* xd,
                          float* xs) {
  const int64_t nb = K / 32;
  alignas(32) int8_t q[32];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float d = quantize_block(x + (r0 + r) * x_stride + b * 32, q);
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) sum += q[j];
      for (int qd = 0; qd < 8; ++qd) std::memcpy(xp + (b * 8 + qd) * R + r, q + 4 * qd, 4);
      xd[b * R + r] = d;
      xs[b * R + r] = d * static_cast<float>(sum);
    }
  }
}

// y[M, N] = Q8(x) @ W^T (+ bias) for 4- or 8-bit W in 32-blocks (x [M, K] fp32, rows x_stride apart).
template <int BITS, bool F16>
void gemm_q8(const KiQWeight& w, const float* x, int64_t m, int64_t x_stride, const float* bias, float* y,
             int64_t y_stride, int nthreads) {
  const int64_t K = w.k, nb = K / 32, N = w.n, groups = (N + GROUP - 1) / GROUP;
  const int64_t blocks = (m + RB - 1) / RB;  // row blocks; the last may be shorter (its own R)
  std::vector<int32_t> xp(static_cast<size_t>(blocks * nb * 8 * RB));
  std::vector<float> xd(static_cast<size_t>(blocks * nb * RB)), xs(static_cast<size_t>(blocks * nb * RB));
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t rb = 0; rb < blocks; ++rb) {
      quantize_rows(x, x_stride, rb * RB, std::min<int64_t>(RB, m - rb * RB), K, xp.data() + rb * nb * 8 * RB,
                    xd.data() + rb * nb * RB, xs.data() + rb * nb * RB);
    }  // implicit barrier: every row quantized before any group starts
    std::vector<uint32_t> wq(static_cast<size_t>(nb * 8 * GROUP));
    std::vector<float> dw(static_cast<size_t>(nb * GROUP)), off(static_cast<size_t>(nb * GROUP));
    const int64_t chunk_blocks = ROW_CHUNK / RB;
    for (int64_t c0 = 0; c0 < blocks; c0 += chunk_blocks) {
      const int64_t c1 = std::min(blocks, c0 + chunk_blocks);
#pragma omp for schedule(static) nowait
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t n0 = g * GROUP;
        const int cols = static_cast<int>(std::min<int64_t>(GROUP, N - n0));
        const bool direct = w.packed && c1 - c0 <= DIRECT_MAX_BLOCKS;
        if (direct) {  // nothing to prepare: rows_q8_packed reads the group's blocks as they are
        } else if (w.packed) {
          unpack_group<BITS>(w.packed, g, nb, wq.data(), dw.data(), off.data());
        } else {
          pack_group<BITS, F16>(w, n0, cols, wq.data(), dw.data(), off.data());
        }
        const uint8_t* src = w.packed ? w.packed + g * nb * PACK_BLOCK<BITS> : nullptr;
        for (int64_t rb = c0; rb < c1; ++rb) {
          const int64_t r0 = rb * RB;
          const int32_t* p = xp.data() + rb * nb * 8 * RB;
          const float *d = xd.data() + rb * nb * RB, *sx = xs.data() + rb * nb * RB;
          auto call = [&](auto r) {
            if (direct) {
              rows_q8_packed<BITS, decltype(r)::value>(src, nb, p, d, sx, r0, n0, cols, bias, y, y_stride);
            } else {
              rows_q8<decltype(r)::value>(wq.data(), dw.data(), off.data(), nb, p, d, sx, r0, n0, cols, bias, y,
                                          y_stride);
            }
          };
          switch (std::min<int64_t>(RB, m - r0)) {
            case 8: call(std::integral_constant<int, 8>{}); break;
            case 7: call(std::integral_constant<int, 7>{}); break;
            case 6: call(std::integral_constant<int, 6>{}); break;
            case 5: call(std::integral_constant<int, 5>{}); break;
            case 4: call(std::integral_constant<int, 4>{}); break;
            case 3: call(std::integral_constant<int, 3>{}); break;
            case 2: call(std::integral_constant<int, 2>{}); break;
            default: call(std::integral_constant<int, 1>{}); break;
          }
        }
      }
    }
  }
}
#endif  // KI_Q8_VNNI

#endif  // KI_Q8_BODY
