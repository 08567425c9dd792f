// y[M, N] = (x[M, K] @ e4m3(W[N, K])^T) * scale[N] (+ bias[N]) for weight-only fp8 (server/quant/cpu_fp8.py):
// W holds float8_e4m3fn codes (OCP 8-bit Floating Point Specification (OFP8) v1.0, E4M3: sign, 4 exponent
// bits biased by 7, 3 mantissa bits; exponent 0 is subnormal, m * 2 ** -9; no infinities, S.1111.111 is NaN),
// one fp32 scale per output row. fp32 activations and sums; every code is exact in fp32, so the result equals
// the dequantize + GEMM reference up to summation order.
//
// Made for decode (M = 1..16): each weight byte is read once per call and widened in registers, the rows of
// W split into one contiguous span per thread. A normal code's 7 magnitude bits shifted to fp32's exponent
// and mantissa fields plus 120 in the exponent give 2 ** (e - 7) * 1.m; a subnormal's mantissa is converted
// and multiplied by 2 ** -9 (no fp32 denormals: a denormals-are-zero MXCSR cannot change the result); the sign
// bit is or-ed in. NaN codes are refused at load (cpu_fp8.check_codes), not decoded.
//
// Three code paths, chosen at run time (kubeinfer_fp8_set_path, from server/cpu_features.py's usable
// features), each compiled into every x86-64 build with GCC's target attribute:
//   avx512  zmm: 16 codes a load, tiles of up to 4 rows of x.
//   avx2    ymm: 8 codes a load, the same tiles.
//   scalar  a 256-entry table, any CPU.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KI_FP8_X86 1
#else
#define KI_FP8_X86 0
#endif

namespace {

constexpr int PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2;
constexpr int MR = 4;  // rows of x a tile keeps accumulators for

struct Table {
  float v[256];
  Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float mag = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(static_cast<float>(m), -9);
      v[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
const Table E4M3;

struct Call {
  const float* x;      // [M, K], rows x_stride apart
  int64_t m, k, x_stride;
  const uint8_t* w;    // [N, K] codes, contiguous
  const float* scale;  // [N]
  const float* bias;   // [N] or null
  float* out;          // [M, N], rows out_stride apart
  int64_t out_stride;
};

inline void store(const Call& c, int64_t i, int64_t j, float sum) {
  c.out[i * c.out_stride + j] = sum * c.scale[j] + (c.bias ? c.bias[j] : 0.0f);
}

void rows_scalar(const Call& c, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* w = c.w + j * c.k;
    for (int64_t i = 0; i < c.m; ++i) {
      const float* x = c.x + i * c.x_stride;
      float sum = 0.0f;
      for (int64_t kk = 0; kk < c.k; ++kk) sum += x[kk] * E4M3.v[w[kk]];
      store(c, i, j, sum);
    }
  }
}

#if KI_FP8_X86
__attribute__((target("avx2,fma"))) inline __m256 decode8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(7))),
                                   _mm256_set1_ps(1.0f / 512.0f));
  const __m256i is_sub = _mm256_cmpeq_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  const __m256 f = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const Call& c, const uint8_t* w, int64_t i0, int64_t j) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= c.k; kk += 8) {
    const __m256 wf = decode8(w + kk);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(c.x + (i0 + r) * c.x_stride + kk), wf, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = hsum8(acc[r]);
    const float* x = c.x + (i0 + r) * c.x_stride;
    for (int64_t t = kk; t < c.k; ++t) sum += x[t] * E4M3.v[w[t]];
    store(c, i0 + r, j, sum);
  }
}

__attribute__((target("avx2,fma"))) void rows_avx2(const Call& c, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* w = c.w + j * c.k;
    int64_t i = 0;
    for (; i + MR <= c.m; i += MR) tile_avx2<MR>(c, w, i, j);
    switch (c.m - i) {
      case 3: tile_avx2<3>(c, w, i, j); break;
      case 2: tile_avx2<2>(c, w, i, j); break;
      case 1: tile_avx2<1>(c, w, i, j); break;
      default: break;
    }
  }
}

__attribute__((target("avx512f"))) inline __m512 decode16(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(7))),
                                   _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, _mm512_set1_epi32(0x78)), _mm512_setzero_si512());
  const __m512 f = _mm512_mask_blend_ps(is_sub, normal, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

template <int R>
__attribute__((target("avx512f"))) void tile_avx512(const Call& c, const uint8_t* w, int64_t i0, int64_t j) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= c.k; kk += 16) {
    const __m512 wf = decode16(w + kk);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(c.x + (i0 + r) * c.x_stride + kk), wf, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = _mm512_reduce_add_ps(acc[r]);
    const float* x = c.x + (i0 + r) * c.x_stride;
    for (int64_t t = kk; t < c.k; ++t) sum += x[t] * E4M3.v[w[t]];
    store(c, i0 + r, j, sum);
  }
}

__attribute__((target("avx512f"))) void rows_avx512(const Call& c, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* w = c.w + j * c.k;
    int64_t i = 0;
    for (; i + MR <= c.m; i += MR) tile_avx512<MR>(c, w, i, j);
    switch (c.m - i) {
      case 3: tile_avx512<3>(c, w, i, j); break;
      case 2: tile_avx512<2>(c, w, i, j); break;
      case 1: tile_avx512<1>(c, w, i, j); break;
      default: break;
    }
  }
}
#endif

int path_in_use = PATH_SCALAR;

int best_compiled_path() {
#if KI_FP8_X86
  return PATH_AVX512;
#else
  return PATH_SCALAR;
#endif
}

}  // namespace

extern "C" {

int32_t kubeinfer_fp8_abi() { return 1; }

// Sets the code path (lowered to what this build has); returns the path in use. The caller passes what the
// CPU's usable features allow (server/quant/cpu_fp8.py path_for).
int32_t kubeinfer_fp8_set_path(int32_t path) {
  path_in_use = std::clamp(path, PATH_SCALAR, best_compiled_path());
  return path_in_use;
}

// Returns 0, or 1 for arguments it cannot take (the Python launcher checks them first).
int32_t kubeinfer_fp8_linear(const uint8_t* w, const float* scale, int64_t n, int64_t k, const float* x, int64_t m,
                             int64_t x_stride, const float* bias, float* out, int64_t out_stride, int32_t threads) {
  if (n <= 0 || k <= 0 || m <= 0 || x_stride < k || out_stride < n || threads <= 0) return 1;
  const Call c{x, m, k, x_stride, w, scale, bias, out, out_stride};
  const int nt = static_cast<int>(std::min<int64_t>(threads, n));
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), count = omp_get_num_threads();
    const int64_t j0 = n * t / count, j1 = n * (t + 1) / count;
    switch (path_in_use) {
#if KI_FP8_X86
      case PATH_AVX512: rows_avx512(c, j0, j1); break;
      case PATH_AVX2: rows_avx2(c, j0, j1); break;
#endif
      default: rows_scalar(c, j0, j1); break;
    }
  }
  return 0;
}

}  // extern "C"
