// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for W in MXFP4 as gpt-oss ships it (server/quant/cpu_mxfp4.py):
// per row n and 32-value block b, `blocks[n, b, 16]` holds 32 e2m1 codes, two per byte, the low nibble first
// (element 2j in the low nibble of byte j), and `scales[n, b]` the block's e8m0 exponent (biased by 127):
// w = e2m1(code) * 2 ** (scale - 127). Source: OCP Microscaling Formats (MX) v1.0, sections 5.3 (e8m0)
// and 5.3.3 (e2m1); the nibble order is transformers' integrations/mxfp4.py `convert_moe_packed_tensors`.
//
// For the MoE experts of one step (few tokens per expert): fp32 activations, fp32 sums, nothing rounded
// but the sums (e2m1 times a power of two is exact in fp32), so it equals the dequantize + fp32 GEMM
// reference up to summation order. Each weight byte is read once per call and decoded in registers: a
// block's 16 bytes widen to 16 int32 codes, the low and high nibbles index a 16-entry fp32 table of the
// e2m1 values already multiplied by the block's scale (one permute each), and the even- and odd-indexed
// values meet x split the same way (x's blocks are rearranged once per call into 16 evens then 16 odds,
// so the nibbles never need interleaving). A tile of NR rows of W times MR rows of x keeps NR * MR
// accumulators in registers; the rows of W are split into one contiguous span per thread, so at M = 1
// every weight byte is read by exactly one thread (the step is bound by the weights' bandwidth).
//
// Three code paths, chosen at run time (kubeinfer_mxfp4_set_path, from server/cpu_features.py's usable
// features), each compiled into every x86-64 build with GCC's target pragma:
//   avx512  zmm: vpermps over the 16-entry table (`_mm512_permutexvar_ps`), 4 x 4 tiles (2 x 8 from M = 8).
//   avx2    ymm: the 8 magnitudes through `vpermps` (`_mm256_permutevar8x32_ps`), the sign bit (code bit 3)
//           xor-ed in, 2 x 2 tiles.
//   scalar  plain C++, any CPU.
#ifndef KI_MX_BODY
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KI_MX_X86 1
#else
#define KI_MX_X86 0
#endif

namespace {

constexpr int PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2;
constexpr int64_t BLOCK = 32;

// e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives.
constexpr float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2 ** (s - 127) for every e8m0 byte: 0 is 2 ** -127 (a subnormal fp32, exact), 255 (NaN in the spec)
// becomes 2 ** 128 = inf, as the reference's ldexp gives.
struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (int s = 0; s < 256; ++s) v[s] = std::ldexp(1.0f, s - 127);
  }
};
const ScaleTable SCALES;

// Arguments of one call, shared by the paths.
struct Call {
  const uint8_t* blocks;  // [N, K / 32, 16]
  const uint8_t* scales;  // [N, K / 32]
  int64_t n, nb;          // rows of W, blocks per row
  const float* xs;        // [M, K]: x with each block's 16 even-indexed values first, then the 16 odd ones
  int64_t m;
  const float* bias;  // [N] or null
  float* y;
  int64_t y_stride;
};

namespace scalar_path {
void rows(const Call& c, int64_t n0, int64_t n1) {
  const int64_t k = c.nb * BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = c.blocks + n * c.nb * 16;
    const uint8_t* s = c.scales + n * c.nb;
    for (int64_t i = 0; i < c.m; ++i) {
      const float* x = c.xs + i * k;
      float acc = 0.0f;
      for (int64_t b = 0; b < c.nb; ++b) {
        float part = 0.0f;
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = q[b * 16 + j];
          part += E2M1[byte & 15] * x[b * BLOCK + j] + E2M1[byte >> 4] * x[b * BLOCK + 16 + j];
        }
        acc += part * SCALES.v[s[b]];
      }
      c.y[i * c.y_stride + n] = acc + (c.bias ? c.bias[n] : 0.0f);
    }
  }
}
}  // namespace scalar_path

}  // namespace

#if KI_MX_X86
#define KI_MX_BODY 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define KI_MX_AVX512 0
namespace {
namespace avx2_path {
#include __FILE__
}
}  // namespace
#undef KI_MX_AVX512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
#define KI_MX_AVX512 1
namespace {
namespace avx512_path {
#include __FILE__
}
}  // namespace
#undef KI_MX_AVX512
#pragma GCC pop_options
#undef KI_MX_BODY
#endif

namespace {

int path_in_use = PATH_SCALAR;

int best_compiled_path() {
#if KI_MX_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return PATH_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return PATH_AVX2;
#endif
  return PATH_SCALAR;
}

}  // namespace

extern "C" {

int32_t kubeinfer_mxfp4_abi() { return 1; }

// The path to run: 2 avx512, 1 avx2, 0 scalar; lowered to what this CPU reports (libgcc's CPUID check, a
// second guard behind Python's OS-enabled features). Returns the path now in use. Process-wide, not
// thread-safe against running kernels.
int32_t kubeinfer_mxfp4_set_path(int32_t path) {
  path_in_use = std::clamp(path, PATH_SCALAR, best_compiled_path());
  return path_in_use;
}

// y[i * y_stride + n] = sum_k x[i * x_stride + k] W[n, k] (+ bias[n]) for i < m, n < n_rows.
// Returns 0, or 2 for arguments it cannot take (null pointers, k not a positive multiple of 32, m or n
// negative, strides shorter than a row).
int32_t kubeinfer_mxfp4_linear(const uint8_t* blocks, const uint8_t* scales, int64_t n_rows, int64_t k,
                               const float* x, int64_t m, int64_t x_stride, const float* bias, float* y,
                               int64_t y_stride, int32_t nthreads) {
  if (!blocks || !scales || !x || !y || n_rows < 0 || m < 0 || k <= 0 || k % BLOCK || x_stride < k ||
      y_stride < n_rows)
    return 2;
  if (m == 0 || n_rows == 0) return 0;
  const int64_t nb = k / BLOCK;
  std::vector<float> xs(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m; ++i) {  // each block: the 16 even-indexed values, then the 16 odd ones
    const float* xi = x + i * x_stride;
    float* out = xs.data() + i * k;
    for (int64_t b = 0; b < nb; ++b)
      for (int j = 0; j < 16; ++j) {
        out[b * BLOCK + j] = xi[b * BLOCK + 2 * j];
        out[b * BLOCK + 16 + j] = xi[b * BLOCK + 2 * j + 1];
      }
  }
  const Call c{blocks, scales, n_rows, nb, xs.data(), m, bias, y, y_stride};
  const int path = path_in_use;
  // Spans in units of 4 rows (the widest tile), so only the last span has a partial tile.
  const int64_t units = (n_rows + 3) / 4;
  const int nt = static_cast<int>(std::clamp<int64_t>(nthreads, 1, std::max<int64_t>(units, 1)));
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t n0 = std::min(n_rows, units * t / T * 4), n1 = std::min(n_rows, units * (t + 1) / T * 4);
    if (n0 < n1) {
#if KI_MX_X86
      if (path == PATH_AVX512)
        avx512_path::rows(c, n0, n1);
      else if (path == PATH_AVX2)
        avx2_path::rows(c, n0, n1);
      else
        scalar_path::rows(c, n0, n1);
#else
      scalar_path::rows(c, n0, n1);
#endif
    }
  }
  return 0;
}

}  // extern "C"

#else  // KI_MX_BODY: one SIMD path, compiled under the target options set around its #include

#if KI_MX_AVX512
constexpr int NR = 4, MR = 4;  // 16 zmm accumulators + 8 decoded + 2 of x

struct Decoded {
  __m512 lo, hi;  // the block's even- and odd-indexed weights, scaled
};

inline Decoded decode(const uint8_t* q, float scale, __m512 lut) {
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512 table = _mm512_mul_ps(lut, _mm512_set1_ps(scale));
  return {_mm512_permutexvar_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)), table),
          _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table)};
}

template <int R, int I>
void tile(const Call& c, int64_t n, int64_t i0) {
  const __m512 lut = _mm512_loadu_ps(E2M1);
  const int64_t k = c.nb * BLOCK;
  __m512 acc[R][I];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < I; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < c.nb; ++b) {
    Decoded w[R];
    for (int r = 0; r < R; ++r)
      w[r] = decode(c.blocks + ((n + r) * c.nb + b) * 16, SCALES.v[c.scales[(n + r) * c.nb + b]], lut);
    for (int i = 0; i < I; ++i) {
      const float* xb = c.xs + (i0 + i) * k + b * BLOCK;
      const __m512 xe = _mm512_loadu_ps(xb), xo = _mm512_loadu_ps(xb + 16);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(w[r].hi, xo, _mm512_fmadd_ps(w[r].lo, xe, acc[r][i]));
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = c.bias ? c.bias[n + r] : 0.0f;
    for (int i = 0; i < I; ++i) c.y[(i0 + i) * c.y_stride + n + r] = _mm512_reduce_add_ps(acc[r][i]) + b;
  }
}
#else
constexpr int NR = 2, MR = 2;  // 4 ymm accumulators + 8 decoded + x: within the 16 ymm registers

struct Decoded {
  __m256 lo0, lo1, hi0, hi1;  // even-indexed weights 0-7, 8-15; odd-indexed 0-7, 8-15; scaled
};

inline __m256 values(__m256i codes, __m256 magnitudes) {  // codes 0..15 -> e2m1 * scale
  const __m256 mag = _mm256_permutevar8x32_ps(magnitudes, codes);  // reads the low 3 bits only
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32(INT32_MIN));
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

inline Decoded decode(const uint8_t* q, float scale, __m256 lut) {
  const __m256 mags = _mm256_mul_ps(lut, _mm256_set1_ps(scale));
  const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
  const __m256i low = _mm256_set1_epi32(15);
  return {values(_mm256_and_si256(c0, low), mags), values(_mm256_and_si256(c1, low), mags),
          values(_mm256_srli_epi32(c0, 4), mags), values(_mm256_srli_epi32(c1, 4), mags)};
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int R, int I>
void tile(const Call& c, int64_t n, int64_t i0) {
  const __m256 lut = _mm256_loadu_ps(E2M1);  // the 8 non-negative values
  const int64_t k = c.nb * BLOCK;
  __m256 acc[R][I];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < I; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < c.nb; ++b) {
    Decoded w[R];
    for (int r = 0; r < R; ++r)
      w[r] = decode(c.blocks + ((n + r) * c.nb + b) * 16, SCALES.v[c.scales[(n + r) * c.nb + b]], lut);
    for (int i = 0; i < I; ++i) {
      const float* xb = c.xs + (i0 + i) * k + b * BLOCK;
      for (int r = 0; r < R; ++r) {
        __m256 a = _mm256_fmadd_ps(w[r].lo0, _mm256_loadu_ps(xb), acc[r][i]);
        a = _mm256_fmadd_ps(w[r].lo1, _mm256_loadu_ps(xb + 8), a);
        a = _mm256_fmadd_ps(w[r].hi0, _mm256_loadu_ps(xb + 16), a);
        acc[r][i] = _mm256_fmadd_ps(w[r].hi1, _mm256_loadu_ps(xb + 24), a);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = c.bias ? c.bias[n + r] : 0.0f;
    for (int i = 0; i < I; ++i) c.y[(i0 + i) * c.y_stride + n + r] = hsum(acc[r][i]) + b;
  }
}
#endif

// The last rem (< I) rows of x from row i: one tile of exactly rem rows.
template <int R, int I>
void tail(const Call& c, int64_t n, int64_t i, int64_t rem) {
  if constexpr (I > 0) {
    if (rem == I)
      tile<R, I>(c, n, i);
    else
      tail<R, I - 1>(c, n, i, rem);
  }
}

// Tiles of R rows of W over every row of x, I at a time, then the leftover rows of x.
template <int R, int I>
void row_group(const Call& c, int64_t n) {
  int64_t i = 0;
  for (; i + I <= c.m; i += I) tile<R, I>(c, n, i);
  tail<R, I - 1>(c, n, i, c.m - i);
}

template <int R, int I>
void rows_by(const Call& c, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) row_group<R, I>(c, n);
  for (; n < n1; ++n) row_group<1, I>(c, n);
}

void rows(const Call& c, int64_t n0, int64_t n1) {
#if KI_MX_AVX512
  // From 8 rows of x, 2 x 8 tiles decode each block of W once per 8 rows instead of once per 4 (the
  // decode is most of the work per weight byte); the same 16 accumulators.
  if (c.m >= 8) return rows_by<2, 8>(c, n0, n1);
#endif
  rows_by<NR, MR>(c, n0, n1);
}

#endif  // KI_MX_BODY
