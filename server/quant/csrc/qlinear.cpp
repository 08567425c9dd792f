// Weight-only quantized linear layers for CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 activations,
// fp32 accumulation, W kept quantized in memory.
//
// Built at run time by server/quant/cpu_qlinear.py (through server/native.py) and called via ctypes: a
// plain C ABI, no torch headers. One weight layout serves every format (GGUF Q4_0 / Q4_1 / Q8_0, Q4_K and
// Q6_K repacked at load, int8 per output channel, int4 group-wise), each row n of W being:
//   q       row_bytes bytes. bits 8: int8 values, one per k. bits 4: blocks of 32 k, 16 bytes each,
//           byte j holding k = 32b + j (low nibble) and k = 32b + j + 16 (high nibble): GGUF's order.
//   scales  [groups] fp16 or fp32     w[n, k] = scale[n, g] * (q[n, k] - zero_point) (+ min[n, g])
//   mins    [groups] or none          with g = k / group_size
// Groups are whole 32-blocks or 16-value runs (Q6_K's 16-value sub-blocks at 8 bits; Q3_K's and Q2_K's
// at 4 bits: a 32-block's low nibbles are one group, its high nibbles the next); an 8-bit single group
// (per-channel int8) may have any K, its last K % 32 values handled one by one.
//
// Two paths, both parallel over output columns (OpenMP, torch's libgomp):
//   gemv    (M <= gemv_max_rows = 4, decode): four rows of W at a time, each 32-block decoded in registers
//           and multiplied into the x row; scales applied once per group; Q4_1's min through sum(x) of
//           the group. With several x rows, W is walked in 32-row chunks that stay in L1 across the rows.
//   batched (larger M): x packed transposed once, 12-row panels of W dequantized once per chunk of x
//           rows into an L1/L2 scratch, then register-blocked micro-kernels (BLIS-style, below), so W
//           still streams from memory once and the FMAs run at the core's peak. (Prefill-sized M goes to
//           dequantize + torch GEMM, chosen in Python.) Crossovers: benchmarks/cpu_qlinear.py.
// The AVX2 code path is compiled where the build machine has AVX2 (-march=native), elsewhere a portable
// path that the compiler vectorizes for the machine's own vector width. On x86-64 the batched path's
// micro-kernel also has an AVX-512 variant, compiled always and chosen at run time (see below), and the
// batched path a bf16 variant (AVX512-BF16, "batched path in bf16" below) for weights whose descriptor
// asks for bf16 compute: x and W rounded to bf16, fp32 sums and output.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KI_AVX2 1
#else
#define KI_AVX2 0
#endif

extern "C" {
struct KiQWeight {
  const uint8_t* q;       // [n, row_bytes]
  const void* scales;     // [n, groups] fp16 (scale_is_f16) or fp32
  const void* mins;       // [n, groups] like scales, or null
  int64_t n, k, group_size, groups, row_bytes;
  int32_t bits, zero_point, scale_is_f16;
  int32_t compute;  // KI_COMPUTE_FP32, KI_COMPUTE_BF16 (the batched path may run in bf16, below) or
                    // KI_COMPUTE_INT8 (int8 activations where a kernel has them; this file computes in fp32)
  const uint8_t* packed;  // qgemv_q8.cpp's packed copy of W for its batched path, or null; unread here
};
}

// KI_COMPUTE_INT8: an fp32 layer whose quantized GEMMs may take int8 activations (gemm_dtype int8,
// server/quant/gemm_dtype.py): qgemv_q8.cpp's and qk_native.cpp's kernels take it as they take bf16; here,
// which has no int8 path, it computes as fp32.
enum : int32_t { KI_COMPUTE_FP32 = 0, KI_COMPUTE_BF16 = 1, KI_COMPUTE_INT8 = 2 };

extern "C" {
}

namespace {

constexpr int NR = 4;  // rows of W per task

inline float half_to_float(uint16_t h) {
#if KI_AVX2
  return _cvtsh_ss(h);
#else
  // IEEE binary16 -> binary32, subnormals included.
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
#endif
}

template <bool F16>
inline float load_scale(const void* p, int64_t i) {
  if constexpr (F16) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

// The integer of W[n, k] (before zero_point), for the scalar paths.
template <int BITS>
inline int q_at(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(row[k]);
  } else {
    const uint8_t byte = row[(k / 32) * 16 + (k % 16)];
    return (k % 32) < 16 ? (byte & 0x0f) : (byte >> 4);
  }
}

template <int BITS>
inline const uint8_t* block_ptr(const uint8_t* row, int64_t b) {
  return row + b * (BITS == 8 ? 32 : 16);
}

#if KI_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 weights of one block -> 4 x 8 floats holding q - zero_point.
template <int BITS>
inline void decode_block(const uint8_t* p, __m256 zp, __m256 out[4]) {
  if constexpr (BITS == 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  } else {
    // 8 bytes widened to 8 x 32-bit lanes hold 16 nibbles: the low ones are k = j, the high ones k = j + 16.
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    out[0] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), zp);
    out[1] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, mask)), zp);
    out[2] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), zp);
    out[3] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), zp);
  }
}

// The raw integers of one block (no zero point): 4 x 8 floats.
template <int BITS>
inline void decode_raw(const uint8_t* p, __m256 out[4]) {
  if constexpr (BITS == 8) {
    decode_block<8>(p, _mm256_setzero_ps(), out);
  } else {
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
    out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
    out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
}

// The 16 values k, k + 1, ..., k + 15 (k a multiple of 16) minus zero_point: 2 x 8 floats. At 4 bits they
// are the low (k % 32 == 0) or high nibbles of the 16 bytes of k's 32-block.
template <int BITS>
inline void decode_run16(const uint8_t* row, int64_t k, __m256 zp, __m256& v0, __m256& v1) {
  if constexpr (BITS == 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    v0 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), zp);
    v1 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))), zp);
  } else {
    const uint8_t* p = row + (k / 32) * 16;
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    if (k % 32) {
      a = _mm256_srli_epi32(a, 4), b = _mm256_srli_epi32(b, 4);
    } else {
      const __m256i mask = _mm256_set1_epi32(0x0f);
      a = _mm256_and_si256(a, mask), b = _mm256_and_si256(b, mask);
    }
    v0 = _mm256_sub_ps(_mm256_cvtepi32_ps(a), zp);
    v1 = _mm256_sub_ps(_mm256_cvtepi32_ps(b), zp);
  }
}

// [sum(v0), sum(v1), ..., sum(v7)]
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// GGUF's 32-value groups with fp16 scales: eight blocks at a time, their dot products reduced into one
// vector and scaled by eight scales loaded together (a broadcast per block would cost more than the dot).
// The zero point and min go through the blocks' sums of x: sum((q - zp) d x) + m sum(x)
//   = d sum(q x) + (m - zp d) sum(x).
template <int BITS>
void gemv_row_g32(const KiQWeight& w, const float* x, const float* xsum, int64_t n, float* y) {
  const int64_t nb = w.k / 32;
  const uint8_t* row = w.q + n * w.row_bytes;
  const uint16_t* sc = static_cast<const uint16_t*>(w.scales) + n * w.groups;
  const uint16_t* mn = w.mins ? static_cast<const uint16_t*>(w.mins) + n * w.groups : nullptr;
  const bool offset = mn || w.zero_point;
  const __m256 zpv = _mm256_set1_ps(static_cast<float>(w.zero_point));
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256 p[8];
    for (int i = 0; i < 8; ++i) {
      __m256 v[4];
      decode_raw<BITS>(block_ptr<BITS>(row, b + i), v);
      const float* xb = x + (b + i) * 32;
      __m256 s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
      s = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), s);
      s = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), s);
      p[i] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), s);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b)));
    acc = _mm256_fmadd_ps(d, hsum8(p), acc);
    if (offset) {
      __m256 off = _mm256_mul_ps(zpv, d);
      if (mn) off = _mm256_sub_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b))), off);
      else off = _mm256_sub_ps(_mm256_setzero_ps(), off);
      acc = _mm256_fmadd_ps(off, _mm256_loadu_ps(xsum + b), acc);
    }
  }
  float tail = 0.0f;
  for (; b < nb; ++b) {
    __m256 v[4];
    decode_raw<BITS>(block_ptr<BITS>(row, b), v);
    const float* xb = x + b * 32;
    __m256 s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), s);
    s = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), s);
    s = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), s);
    const float d = half_to_float(sc[b]);
    tail += d * hsum(s);
    if (offset) tail += ((mn ? half_to_float(mn[b]) : 0.0f) - static_cast<float>(w.zero_point) * d) * xsum[b];
  }
  *y = hsum(acc) + tail;
}
#endif

// Rows [n0, n0 + R) of W dequantized into tile[r * ldt + k], k < K.
template <int BITS, bool F16>
void dequant_rows(const KiQWeight& w, const int64_t* rows, int64_t n0, int R, float* tile, int64_t ldt) {
  const int64_t K = w.k, G = w.group_size;
  const float zpf = static_cast<float>(w.zero_point);
  for (int r = 0; r < R; ++r) {
    const int64_t n = rows ? rows[n0 + r] : n0 + r;
    const uint8_t* row = w.q + n * w.row_bytes;
    float* out = tile + r * ldt;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float d = load_scale<F16>(w.scales, n * w.groups + g);
      const float m = w.mins ? load_scale<F16>(w.mins, n * w.groups + g) : 0.0f;
      const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
      int64_t k = k0;
#if KI_AVX2
      const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m), zp = _mm256_set1_ps(zpf);
      for (; k + 32 <= k1; k += 32) {
        __m256 v[4];
        decode_block<BITS>(block_ptr<BITS>(row, k / 32), zp, v);
        for (int i = 0; i < 4; ++i) {
          // d * q is exact in fp32 (11-bit fp16 mantissa times an 8-bit integer): adding m rounds once,
          // the same value as the reference dequantization.
          _mm256_storeu_ps(out + k + 8 * i, _mm256_add_ps(_mm256_mul_ps(dv, v[i]), mv));
        }
      }
      for (; k + 16 <= k1; k += 16) {  // 16-value groups (Q6_K; Q3_K and Q2_K at 4 bits)
        __m256 v0, v1;
        decode_run16<BITS>(row, k, zp, v0, v1);
        _mm256_storeu_ps(out + k, _mm256_add_ps(_mm256_mul_ps(dv, v0), mv));
        _mm256_storeu_ps(out + k + 8, _mm256_add_ps(_mm256_mul_ps(dv, v1), mv));
      }
#endif
      for (; k < k1; ++k) out[k] = d * (static_cast<float>(q_at<BITS>(row, k)) - zpf) + m;
    }
  }
}

// One x row against rows [n0, n0 + R) of W: y[r] = sum_k W[n0 + r, k] * x[k].
template <int BITS, bool F16, int R>
void gemv_rows(const KiQWeight& w, const float* x, int64_t n0, float* y) {
  const int64_t K = w.k, G = w.group_size;
  const float zpf = static_cast<float>(w.zero_point);
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.q + (n0 + r) * w.row_bytes;
  float tail[R] = {};
#if KI_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256 zp = _mm256_set1_ps(zpf);
#endif
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
    int64_t k = k0;
#if KI_AVX2
    __m256 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
    __m256 xsum = _mm256_setzero_ps();
    for (; k + 32 <= k1; k += 32) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      const __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
      if (w.mins) xsum = _mm256_add_ps(xsum, _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
      for (int r = 0; r < R; ++r) {
        __m256 v[4];
        decode_block<BITS>(block_ptr<BITS>(row[r], k / 32), zp, v);
        __m256 p = _mm256_mul_ps(v[0], x0);
        p = _mm256_fmadd_ps(v[1], x1, p);
        p = _mm256_fmadd_ps(v[2], x2, p);
        p = _mm256_fmadd_ps(v[3], x3, p);
        part[r] = _mm256_add_ps(part[r], p);
      }
    }
    for (; k + 16 <= k1; k += 16) {  // 16-value groups (Q6_K; Q3_K and Q2_K at 4 bits)
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      if (w.mins) xsum = _mm256_add_ps(xsum, _mm256_add_ps(x0, x1));
      for (int r = 0; r < R; ++r) {
        __m256 v0, v1;
        decode_run16<BITS>(row[r], k, zp, v0, v1);
        part[r] = _mm256_fmadd_ps(v1, x1, _mm256_fmadd_ps(v0, x0, part[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(load_scale<F16>(w.scales, n * w.groups + g)), part[r], acc[r]);
      if (w.mins) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(load_scale<F16>(w.mins, n * w.groups + g)), xsum, acc[r]);
    }
#endif
    if (k < k1) {  // the rest of the group, one value at a time (the whole group without AVX2)
      float xs = 0.0f;
      for (int64_t j = k; j < k1; ++j) xs += x[j];
      for (int r = 0; r < R; ++r) {
        const int64_t n = n0 + r;
        float s = 0.0f;
        for (int64_t j = k; j < k1; ++j) s += (static_cast<float>(q_at<BITS>(row[r], j)) - zpf) * x[j];
        tail[r] += load_scale<F16>(w.scales, n * w.groups + g) * s;
        if (w.mins) tail[r] += load_scale<F16>(w.mins, n * w.groups + g) * xs;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
#if KI_AVX2
    y[r] = hsum(acc[r]) + tail[r];
#else
    y[r] = tail[r];
#endif
  }
}

// ---------------------------------------------------------------- batched path (M > 1)
// Register-blocked GEMM on a dequantized panel, the BLIS way with the operands' roles swapped so that no
// weight is ever transposed: y^T[n, m] = sum_k W[n, k] x^T[k, m].
//   - x is packed once per call, transposed, in blocks of MB = 8 * MV rows: xt[k * MB + i] = x[m0 + i, k]
//     (zero-padded past M), so one k gives MV vectors along m;
//   - PR rows of W are dequantized once into a thread-local panel wt[PR][K] (L1/L2-sized) and reused
//     against every block of x: each weight is decoded once per M chunk, not once per row of x;
//   - the micro-kernel keeps PR x MV accumulators in registers (12 of AVX2's 16), broadcasting one
//     weight per row and FMA-ing it into MV vectors of x: MV loads + PR broadcasts per PR * MV FMAs.
// Tiles: 6 x 16 (MV = 2) for blocks of 16 rows of x, 12 x 8 (MV = 1) for the last 8 or fewer, so a ragged
// or small M wastes at most 7 padded rows. x is processed in chunks of rows whose packed copy is
// PACKED_X_BYTES (L2-resident), W's panels dequantized again per chunk.
template <int MV>
constexpr int panel_rows() {
  return MV == 2 ? 6 : 12;
}

// c[r * MB + i] = sum_k wt[r * K + k] * xt[k * MB + i], r < PR, i < MB = 8 * MV.
template <int MV>
void micro_kernel(const float* wt, int64_t K, const float* xt, float* c) {
  [[maybe_unused]] constexpr int PR = panel_rows<MV>(), MB = 8 * MV;
#if KI_AVX2
  // Named accumulators, not an array: GCC keeps an array of __m256 in memory, storing it every iteration.
  if constexpr (MV == 2) {
    const float *w0 = wt, *w1 = wt + K, *w2 = wt + 2 * K, *w3 = wt + 3 * K, *w4 = wt + 4 * K, *w5 = wt + 5 * K;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_loadu_ps(xt + k * 16), b1 = _mm256_loadu_ps(xt + k * 16 + 8);
      __m256 a = _mm256_broadcast_ss(w0 + k);
      c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
      a = _mm256_broadcast_ss(w1 + k);
      c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
      a = _mm256_broadcast_ss(w2 + k);
      c20 = _mm256_fmadd_ps(a, b0, c20), c21 = _mm256_fmadd_ps(a, b1, c21);
      a = _mm256_broadcast_ss(w3 + k);
      c30 = _mm256_fmadd_ps(a, b0, c30), c31 = _mm256_fmadd_ps(a, b1, c31);
      a = _mm256_broadcast_ss(w4 + k);
      c40 = _mm256_fmadd_ps(a, b0, c40), c41 = _mm256_fmadd_ps(a, b1, c41);
      a = _mm256_broadcast_ss(w5 + k);
      c50 = _mm256_fmadd_ps(a, b0, c50), c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    const __m256 out[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 12; ++i) _mm256_storeu_ps(c + 8 * i, out[i]);
  } else {
    const float* w0 = wt;
    const int64_t K2 = 2 * K, K3 = 3 * K;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m256 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b = _mm256_loadu_ps(xt + k * 8);
      const float* p = w0 + k;
      c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p), b, c0);
      c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K), b, c1);
      c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K2), b, c2);
      p += K3;
      c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(p), b, c3);
      c4 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K), b, c4);
      c5 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K2), b, c5);
      p += K3;
      c6 = _mm256_fmadd_ps(_mm256_broadcast_ss(p), b, c6);
      c7 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K), b, c7);
      c8 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K2), b, c8);
      p += K3;
      c9 = _mm256_fmadd_ps(_mm256_broadcast_ss(p), b, c9);
      c10 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K), b, c10);
      c11 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + K2), b, c11);
    }
    const __m256 out[12] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
    for (int i = 0; i < 12; ++i) _mm256_storeu_ps(c + 8 * i, out[i]);
  }
#else
  for (int r = 0; r < PR; ++r) {
    float acc[MB] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float a = wt[r * K + k];
      for (int i = 0; i < MB; ++i) acc[i] += a * xt[k * MB + i];
    }
    for (int i = 0; i < MB; ++i) c[r * MB + i] = acc[i];
  }
#endif
}

// AVX-512: one 12 x 16 tile (a 16-row block of x against the whole 12-row panel, 12 zmm accumulators)
// instead of two 6 x 16 AVX2 tiles. Compiled on every x86-64 build through a target attribute and chosen
// at run time (avx512_enabled) only on a CPU that reports avx512f; the AVX2 path runs everywhere else.
// Run by the tests on an AVX-512 machine (AMD EPYC family 25, 2026-12-01); KUBEINFER_CPU_DISABLE=avx512 forces the AVX2 path.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && KI_AVX2
#define KI_AVX512_PATH 1
__attribute__((target("avx512f"))) void micro_kernel_12x16_avx512(const float* wt, int64_t K, const float* xt,
                                                                  float* c) {
  __m512 acc[12];
  // Fully unrolled over the 12 rows: GCC keeps them in zmm registers (32 of them), unlike the AVX2 case.
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = _mm512_loadu_ps(xt + k * 16);
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(wt[r * K + k]), b, acc[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) _mm512_storeu_ps(c + r * 16, acc[r]);
}

// Set from Python (server/cpu_features.py: AVX-512 state enabled in XCR0 and not turned off by
// KUBEINFER_CPU_DISABLE) before the first call; libgcc's check alone stays as a second guard.
bool avx512_allowed = false;
bool avx512_enabled() {
  static const bool on = __builtin_cpu_supports("avx512f");
  return on && avx512_allowed;
}
#else
#define KI_AVX512_PATH 0
bool avx512_allowed = false;
inline bool avx512_enabled() { return false; }
#endif

// x rows [m0, m0 + mb), mb <= MB, transposed into xt[k * MB + i], zero past mb.
template <int MB>
void pack_x(const float* x, int64_t x_stride, int64_t m0, int64_t mb, int64_t K, float* xt) {
  for (int64_t k0 = 0; k0 < K; k0 += 64) {  // 64 k at a time: the MB source rows' lines stay in L1
    const int64_t k1 = std::min(K, k0 + 64);
    for (int64_t i = 0; i < MB; ++i) {
      if (i < mb) {
        const float* xr = x + (m0 + i) * x_stride;
        for (int64_t k = k0; k < k1; ++k) xt[k * MB + i] = xr[k];
      } else {
        for (int64_t k = k0; k < k1; ++k) xt[k * MB + i] = 0.0f;
      }
    }
  }
}

// One panel of W (rows [n0, n0 + rows), dequantized in wt) against x rows [m0, m0 + mb) (packed in xt).
template <int MV>
void panel_block(const float* wt, int64_t K, const float* xt, int64_t m0, int64_t mb, int64_t n0, int rows,
                 const float* bias, float* y, int64_t y_stride) {
  constexpr int PR = panel_rows<MV>(), MB = 8 * MV;
  alignas(32) float c[PR * MB];
  micro_kernel<MV>(wt, K, xt, c);
  for (int64_t i = 0; i < mb; ++i) {
    float* yr = y + (m0 + i) * y_stride + n0;
    for (int r = 0; r < rows; ++r) yr[r] = c[r * MB + i] + (bias ? bias[n0 + r] : 0.0f);
  }
}

constexpr int64_t PACKED_X_BYTES = 512 << 10;  // x rows per chunk: their packed copy stays in L2 (1 MiB here)
constexpr int PANEL = 12;  // rows of W dequantized at a time: two 6 x 16 tiles or one 12 x 8 tile

// One x row against rows [n0, n1) of W: y[n] = sum_k W[n, k] x[k] (+ bias[n]). xsum: the row's 32-block
// sums (the GGUF path), or null.
template <int BITS, bool F16>
void gemv_span(const KiQWeight& w, const float* x, const float* xsum, int64_t n0, int64_t n1, const float* bias,
               float* y) {
#if KI_AVX2
  if (xsum) {
    for (int64_t n = n0; n < n1; ++n) {
      gemv_row_g32<BITS>(w, x, xsum, n, y + n);
      if (bias) y[n] += bias[n];
    }
    return;
  }
#endif
  int64_t n = n0;
  float out[NR];
  for (; n + NR <= n1; n += NR) {
    gemv_rows<BITS, F16, NR>(w, x, n, out);
    for (int r = 0; r < NR; ++r) y[n + r] = out[r] + (bias ? bias[n + r] : 0.0f);
  }
  for (; n < n1; ++n) {
    gemv_rows<BITS, F16, 1>(w, x, n, out);
    y[n] = out[0] + (bias ? bias[n] : 0.0f);
  }
}

// Rows of x up to this many take the GEMV path (W re-read from L1/L2 per row, decoded in registers);
// from here on the dequantized-panel GEMM (measured by benchmarks/cpu_qlinear.py, `small_m`).
// A tuning knob (kubeinfer_qlinear_set_gemv_max_rows) only so that the benchmark can measure both paths.
int64_t gemv_max_rows = 4;
// Under bf16 compute the batched path is cheaper, so it takes over from M = 4 (`small_m`'s panel_bf16 rows:
// 1.2x the fp32 GEMV at M = 4, even at M = 3, AMD EPYC family 25, 2026-12-01).
int64_t bf16_gemv_max_rows = 3;
constexpr int64_t GEMV_CHUNK = 32;  // rows of W per task when several x rows share them: ~9-18 KiB, in L1

// ---------------------------------------------------------------- batched path in bf16 (AVX512-BF16)
// For a weight whose descriptor asks for bf16 compute (`compute` = KI_COMPUTE_BF16: the layer's
// gemm_dtype is bf16, server/quant/gemm_dtype.py) on a CPU where avx512_bf16 is usable: the same panels
// and chunks as the fp32 batched path, but both operands rounded to bf16 (round to nearest even, as
// torch's .bfloat16(); the instruction treats fp32 denormals as zero) and multiplied by vdpbf16ps, two
// bf16 products per fp32 lane, accumulated in fp32: 32 multiply-adds per instruction against the fp32
// FMA's 16. The output stays fp32 (y = round_bf16(x) @ round_bf16(W)^T + bias up to fp32 summation).
//   - x rows packed per 16-row block as k-pairs: xb[p * 16 + i] = (x[i, 2p], x[i, 2p + 1]) as two bf16
//     in one 32-bit word (zero past M and past an odd K), so one k-pair of the block is one zmm;
//   - W's 12-row panel dequantized to fp32 as before, then rounded to bf16 rows whose consecutive k-pairs
//     are 32-bit words, so each row's pair is one 32-bit broadcast;
//   - micro-kernels 12 x 32 (two 16-row blocks, 24 zmm accumulators: each broadcast feeds two
//     instructions), 12 x 16 (12 zmm accumulators, one load of x and 12 broadcasts per k-pair) and
//     12 x 8 (ymm) for the rows past the 16-row blocks; all sum each output in the same order.
// Compiled on every x86-64 build through a target attribute like the AVX-512 path; chosen at run time
// only where bf16_enabled() (Python's usable_cpu_features: avx512_bf16 and avx512bw, not turned off by
// KUBEINFER_CPU_DISABLE).
#if KI_AVX512_PATH
#define KI_BF16_PATH 1
#define KI_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// src[0, K) -> dst[0, 2 * ceil(K / 2)) bf16 bits, the pad of an odd K zero.
KI_BF16_TARGET void to_bf16_row(const float* src, int64_t K, uint16_t* dst) {
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
    _mm512_storeu_si512(dst + k, (__m512i)v);
  }
  if (k < K) {
    const int64_t r = K - k, padded = (r + 1) & ~int64_t{1};
    const __mmask16 lo = r >= 16 ? 0xffff : static_cast<__mmask16>((1u << r) - 1);
    const __mmask16 hi = r > 16 ? static_cast<__mmask16>((1u << (r - 16)) - 1) : 0;
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + k + 16), _mm512_maskz_loadu_ps(lo, src + k));
    _mm512_mask_storeu_epi16(dst + k, static_cast<__mmask32>((uint64_t{1} << padded) - 1), (__m512i)v);
  }
}

// Row n of W dequantized straight to bf16 (dst[0, K)), for weights whose groups are whole 32-blocks
// (K and group_size multiples of 32: every 4-bit format, Q8_0, per-channel int8 with K % 32 == 0): the
// values of dequant_rows (d * (q - zero_point) + m, the same two roundings), rounded like to_bf16_row,
// without the fp32 row in between.
template <int BITS, bool F16>
KI_BF16_TARGET void dequant_row_bf16_g32(const KiQWeight& w, int64_t n, uint16_t* dst) {
  const uint8_t* row = w.q + n * w.row_bytes;
  const int64_t blocks_per_group = w.group_size / 32;
  const __m512 zp = _mm512_set1_ps(static_cast<float>(w.zero_point));
  const bool zp_on = w.zero_point != 0;
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512 d = _mm512_set1_ps(load_scale<F16>(w.scales, n * w.groups + g));
    const __m512 m = _mm512_set1_ps(w.mins ? load_scale<F16>(w.mins, n * w.groups + g) : 0.0f);
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m512 lo, hi;  // k = 32b + [0, 16) and 32b + [16, 32)
      if constexpr (BITS == 8) {
        const __m128i* p = reinterpret_cast<const __m128i*>(row + 32 * b);
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
      } else {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b)));
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f)));
        hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
      }
      // The zero point and the min only where the format has them (predictable branches): subtracting
      // 0 or adding 0 changes no value but the sign of a zero, which no sum sees.
      if (zp_on) lo = _mm512_sub_ps(lo, zp), hi = _mm512_sub_ps(hi, zp);
      lo = _mm512_mul_ps(d, lo), hi = _mm512_mul_ps(d, hi);
      if (w.mins) lo = _mm512_add_ps(lo, m), hi = _mm512_add_ps(hi, m);
      _mm512_storeu_si512(dst + 32 * b, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// c[r * 16 + i] = sum_p bf16 dot(wb[r * KP + p], xb[p * 16 + i]), r < 12, i < 16, fp32 sums.
KI_BF16_TARGET void micro_kernel_12x16_bf16(const uint32_t* wb, int64_t KP, const uint32_t* xb, float* c) {
  __m512 acc[12];
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    const __m512bh b = (__m512bh)_mm512_loadu_si512(xb + p * 16);
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(wb[r * KP + p])), b);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) _mm512_storeu_ps(c + r * 16, acc[r]);
}

// Two 16-row blocks at once (xb0, xb1 = xb0 + 16 KP): 24 accumulators, each broadcast of W feeding two
// vdpbf16ps; c[r * 32 + i], i < 16 from xb0, i >= 16 from xb1.
KI_BF16_TARGET void micro_kernel_12x32_bf16(const uint32_t* wb, int64_t KP, const uint32_t* xb0, float* c) {
  const uint32_t* xb1 = xb0 + 16 * KP;
  __m512 acc0[12], acc1[12];
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) acc0[r] = _mm512_setzero_ps(), acc1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(xb0 + p * 16);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(xb1 + p * 16);
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(wb[r * KP + p]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) _mm512_storeu_ps(c + r * 32, acc0[r]), _mm512_storeu_ps(c + r * 32 + 16, acc1[r]);
}

// The same on 8 rows of x (ymm, AVX512VL): decode batches of 4..8 rows and the rest past the 16-row
// blocks, at half the work of a zero-padded 16-row block.
KI_BF16_TARGET void micro_kernel_12x8_bf16(const uint32_t* wb, int64_t KP, const uint32_t* xb, float* c) {
  __m256 acc[12];
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    const __m256bh b = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + p * 8));
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) {
      acc[r] = _mm256_dpbf16_ps(acc[r], (__m256bh)_mm256_set1_epi32(static_cast<int>(wb[r * KP + p])), b);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) _mm256_storeu_ps(c + r * 8, acc[r]);
}

// Set from Python (usable_cpu_features) before the first call, like avx512_allowed.
bool bf16_allowed = false;
bool bf16_enabled() {
  static const bool on = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return on && bf16_allowed;
}

// x rows [m0, m0 + mb), mb <= MB, packed as k-pairs into xb[p * MB + i] (zero past mb); pairs: scratch of
// KP words (to_bf16_row writes them through intrinsics, which may alias).
template <int MB>
void pack_x_bf16(const float* x, int64_t x_stride, int64_t m0, int64_t mb, int64_t K, int64_t KP, uint32_t* pairs,
                 uint32_t* xb) {
  for (int64_t i = 0; i < MB; ++i) {
    if (i < mb) {
      to_bf16_row(x + (m0 + i) * x_stride, K, reinterpret_cast<uint16_t*>(pairs));
      for (int64_t p = 0; p < KP; ++p) xb[p * MB + i] = pairs[p];
    } else {
      for (int64_t p = 0; p < KP; ++p) xb[p * MB + i] = 0;
    }
  }
}

// One dequantized bf16 panel (wb) against the packed x rows [m0, m0 + mb) of one block (xb, MB rows).
template <int MB>
void panel_block_bf16(const uint32_t* wb, int64_t KP, const uint32_t* xb, int64_t m0, int64_t mb, int64_t n0,
                      int rows, const float* bias, float* y, int64_t y_stride) {
  alignas(64) float c[PANEL * MB];
  if constexpr (MB == 32) {
    micro_kernel_12x32_bf16(wb, KP, xb, c);
  } else if constexpr (MB == 16) {
    micro_kernel_12x16_bf16(wb, KP, xb, c);
  } else {
    micro_kernel_12x8_bf16(wb, KP, xb, c);
  }
  for (int64_t i = 0; i < mb; ++i) {
    float* yr = y + (m0 + i) * y_stride + n0;
    for (int r = 0; r < rows; ++r) yr[r] = c[r * MB + i] + (bias ? bias[n0 + r] : 0.0f);
  }
}

// The fp32 batched path's structure (qlinear below): x packed whole (16-row blocks, then 8-row blocks for
// the rest), one pass over W's panels per chunk of 16-row blocks, the 8-row blocks in the last chunk.
template <int BITS, bool F16>
void batched_bf16(const KiQWeight& w, const float* x, int64_t m, int64_t x_stride, const float* bias, float* y,
                  int64_t y_stride, int nthreads) {
  const int64_t N = w.n, K = w.k, KP = (K + 1) / 2;
  const int64_t full = m / 16 * 16, nb16 = full / 16, nb8 = (m - full + 7) / 8;
  const int64_t per_chunk = std::max<int64_t>(1, PACKED_X_BYTES / (64 * KP));  // 16-row blocks per chunk
  const int64_t chunks = std::max<int64_t>(1, (nb16 + per_chunk - 1) / per_chunk);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const bool g32 = K % 32 == 0 && w.group_size % 32 == 0;  // dequant_row_bf16_g32 takes it
  std::vector<uint32_t> xb(static_cast<size_t>((full + 8 * nb8) * KP));
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<uint32_t> pairs(static_cast<size_t>(KP));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb16 + nb8; ++b) {
      if (b < nb16) {
        pack_x_bf16<16>(x, x_stride, 16 * b, 16, K, KP, pairs.data(), xb.data() + 16 * b * KP);
      } else {
        const int64_t i0 = full + 8 * (b - nb16);
        pack_x_bf16<8>(x, x_stride, i0, std::min<int64_t>(8, m - i0), K, KP, pairs.data(), xb.data() + i0 * KP);
      }
    }
    std::vector<float> wt(g32 ? 0 : static_cast<size_t>(PANEL * K));
    std::vector<uint32_t> wb(static_cast<size_t>(PANEL * KP), 0);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t b0 = c * per_chunk, b1 = std::min(nb16, b0 + per_chunk);
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = p * PANEL;
        const int rows = static_cast<int>(std::min<int64_t>(PANEL, N - n0));
        if (g32) {
          for (int r = 0; r < rows; ++r) {
            dequant_row_bf16_g32<BITS, F16>(w, n0 + r, reinterpret_cast<uint16_t*>(wb.data() + r * KP));
          }
        } else {
          dequant_rows<BITS, F16>(w, nullptr, n0, rows, wt.data(), K);
          for (int r = 0; r < rows; ++r) {
            to_bf16_row(wt.data() + r * K, K, reinterpret_cast<uint16_t*>(wb.data() + r * KP));
          }
        }
        if (rows < PANEL) std::memset(wb.data() + rows * KP, 0, sizeof(uint32_t) * (PANEL - rows) * KP);
        int64_t b = b0;
        for (; b + 1 < b1; b += 2) {  // pairs of 16-row blocks: 1.1-1.2x the single-block kernel at M >= 32
          panel_block_bf16<32>(wb.data(), KP, xb.data() + 16 * b * KP, 16 * b, 32, n0, rows, bias, y, y_stride);
        }
        for (; b < b1; ++b) {
          panel_block_bf16<16>(wb.data(), KP, xb.data() + 16 * b * KP, 16 * b, 16, n0, rows, bias, y, y_stride);
        }
        if (c + 1 == chunks) {
          for (int64_t i0 = full; i0 < m; i0 += 8) {
            panel_block_bf16<8>(wb.data(), KP, xb.data() + i0 * KP, i0, std::min<int64_t>(8, m - i0), n0, rows,
                                bias, y, y_stride);
          }
        }
      }
    }
  }
}

// Rows [row0, row0 + nrows) of W straight to bf16 (dequant_row_bf16_g32 per row): the bf16 library GEMM's
// operand without an fp32 copy of W in between (half the bytes written, no separate rounding pass).
template <int BITS, bool F16>
KI_BF16_TARGET void dequant_bf16(const KiQWeight& w, int64_t row0, int64_t nrows, uint16_t* out,
                                 int64_t out_stride, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nrows * w.k >= (1 << 16))
  for (int64_t i = 0; i < nrows; ++i) dequant_row_bf16_g32<BITS, F16>(w, row0 + i, out + i * out_stride);
}
#else
#define KI_BF16_PATH 0
bool bf16_allowed = false;
inline bool bf16_enabled() { return false; }
template <int BITS, bool F16>
void batched_bf16(const KiQWeight&, const float*, int64_t, int64_t, const float*, float*, int64_t, int) {}
template <int BITS, bool F16>
void dequant_bf16(const KiQWeight&, int64_t, int64_t, uint16_t*, int64_t, int) {}
#endif

template <int BITS, bool F16>
void qlinear(const KiQWeight& w, const float* x, int64_t m, int64_t x_stride, const float* bias, float* y,
             int64_t y_stride, int nthreads) {
  const int64_t N = w.n, K = w.k;
  const bool bf16 = w.compute == KI_COMPUTE_BF16 && bf16_enabled();
  if (m <= (bf16 ? bf16_gemv_max_rows : gemv_max_rows)) {
    const bool g32 = KI_AVX2 && F16 && w.group_size == 32;
    std::vector<float> xsum(g32 ? static_cast<size_t>(m * (K / 32)) : 0);
    for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
      const float* xb = x + (i / (K / 32)) * x_stride + (i % (K / 32)) * 32;
      float s = 0.0f;
      for (int j = 0; j < 32; ++j) s += xb[j];
      xsum[i] = s;
    }
    auto xs = [&](int64_t i) { return g32 ? xsum.data() + i * (K / 32) : nullptr; };
    if (m == 1) {  // one contiguous span of W per thread, each weight read once
#pragma omp parallel num_threads(nthreads)
      {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = N * t / T / NR * NR, n1 = t + 1 == T ? N : N * (t + 1) / T / NR * NR;
        gemv_span<BITS, F16>(w, x, xs(0), n0, n1, bias, y);
      }
      return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < (N + GEMV_CHUNK - 1) / GEMV_CHUNK; ++c) {
      const int64_t n0 = c * GEMV_CHUNK, n1 = std::min(N, n0 + GEMV_CHUNK);
      for (int64_t i = 0; i < m; ++i) gemv_span<BITS, F16>(w, x + i * x_stride, xs(i), n0, n1, bias, y + i * y_stride);
    }
    return;
  }
  if (bf16) {
    batched_bf16<BITS, F16>(w, x, m, x_stride, bias, y, y_stride, nthreads);
    return;
  }
  // M > 1: x packed whole (its 16-row blocks, then 8-row blocks for the rest), then one pass over W's
  // 12-row panels per chunk of x rows. A single parallel region with one barrier (after packing): on a
  // shared, oversubscribed machine every barrier can cost a scheduler time slice.
  const int64_t full = m / 16 * 16, rest = m - full, nb16 = full / 16, nb8 = (rest + 7) / 8;
  const int64_t per_chunk = std::max<int64_t>(1, PACKED_X_BYTES / (64 * K));  // 16-row blocks per chunk
  const int64_t chunks = std::max<int64_t>(1, (nb16 + per_chunk - 1) / per_chunk);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  [[maybe_unused]] const bool avx512 = avx512_enabled();
  std::vector<float> xt(static_cast<size_t>((full + 8 * nb8) * K));
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb16 + nb8; ++b) {
      if (b < nb16) {
        pack_x<16>(x, x_stride, 16 * b, 16, K, xt.data() + 16 * b * K);
      } else {
        const int64_t i0 = full + 8 * (b - nb16);
        pack_x<8>(x, x_stride, i0, std::min<int64_t>(8, m - i0), K, xt.data() + i0 * K);
      }
    }
    std::vector<float> wt(static_cast<size_t>(PANEL * K));
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t b0 = c * per_chunk, b1 = std::min(nb16, b0 + per_chunk);
      // Static schedule: a thread keeps the same panels in every chunk, so no barrier between chunks.
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = p * PANEL;
        const int rows = static_cast<int>(std::min<int64_t>(PANEL, N - n0));
        dequant_rows<BITS, F16>(w, nullptr, n0, rows, wt.data(), K);
        if (rows < PANEL) std::memset(wt.data() + rows * K, 0, sizeof(float) * (PANEL - rows) * K);
        for (int64_t b = b0; b < b1; ++b) {
#if KI_AVX512_PATH
          if (avx512) {
            alignas(64) float c16[PANEL * 16];
            micro_kernel_12x16_avx512(wt.data(), K, xt.data() + 16 * b * K, c16);
            for (int64_t i = 0; i < 16; ++i) {
              float* yr = y + (16 * b + i) * y_stride + n0;
              for (int r = 0; r < rows; ++r) yr[r] = c16[r * 16 + i] + (bias ? bias[n0 + r] : 0.0f);
            }
            continue;
          }
#endif
          for (int r0 = 0; r0 < rows; r0 += 6) {
            panel_block<2>(wt.data() + r0 * K, K, xt.data() + 16 * b * K, 16 * b, 16, n0 + r0,
                           std::min(6, rows - r0), bias, y, y_stride);
          }
        }
        if (c + 1 == chunks) {
          for (int64_t i0 = full; i0 < m; i0 += 8) {
            panel_block<1>(wt.data(), K, xt.data() + i0 * K, i0, std::min<int64_t>(8, m - i0), n0, rows, bias, y,
                           y_stride);
          }
        }
      }
    }
  }
}

template <int BITS, bool F16>
void dequant(const KiQWeight& w, const int64_t* rows, int64_t row0, int64_t nrows, float* out,
             int64_t out_stride, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nrows * w.k >= (1 << 16))
  for (int64_t i = 0; i < nrows; ++i) {
    if (rows) {
      dequant_rows<BITS, F16>(w, rows, i, 1, out + i * out_stride, out_stride);
    } else {
      dequant_rows<BITS, F16>(w, nullptr, row0 + i, 1, out + i * out_stride, out_stride);
    }
  }
}

bool valid(const KiQWeight* w) {
  if (!w || !w->q || !w->scales || w->n < 0 || w->k < 1 || w->group_size < 1 || w->groups < 1) return false;
  if (w->bits != 4 && w->bits != 8) return false;
  if (w->compute < KI_COMPUTE_FP32 || w->compute > KI_COMPUTE_INT8) return false;
  if ((w->groups - 1) * w->group_size >= w->k || w->groups * w->group_size < w->k) return false;
  // 4-bit groups: whole 32-blocks, or the 16-value halves of every 32-block (a group never straddles a block)
  if (w->bits == 4 && (w->k % 32 || (w->group_size % 32 && w->group_size != 16) || w->row_bytes != w->k / 2)) {
    return false;
  }
  if (w->bits == 8 && (w->row_bytes != w->k || (w->groups > 1 && w->group_size % 16))) return false;
  return true;
}

// Weights held as GGUF's own k-quant super-blocks (bits KI_BITS_KQUANT: cpu_qk_native.py) run in
// csrc/qk_native.cpp, a library of its own: Python hands its entry points here at load
// (kubeinfer_qlinear_set_kquant), so that every caller of this entry point (the decode graph, the int8
// library's fallback, MoE tasks) takes them as it takes any other descriptor.
constexpr int32_t KI_BITS_KQUANT = 6;
using KiKQuantLinearFn = int32_t (*)(const KiQWeight*, const float*, int64_t, int64_t, const float*, float*, int64_t,
                                     int32_t);
using KiKQuantDequantFn = int32_t (*)(const KiQWeight*, const int64_t*, int64_t, int64_t, float*, int64_t, int32_t);
KiKQuantLinearFn kquant_linear = nullptr;
KiKQuantDequantFn kquant_dequant = nullptr;

template <typename F>
int dispatch(const KiQWeight* w, F&& f) {
  if (!valid(w)) return 1;
  if (w->bits == 4) {
    w->scale_is_f16 ? f.template operator()<4, true>() : f.template operator()<4, false>();
  } else {
    w->scale_is_f16 ? f.template operator()<8, true>() : f.template operator()<8, false>();
  }
  return 0;
}

}  // namespace

extern "C" {

int32_t kubeinfer_qlinear_abi() { return 7; }

// The k-quant super-block library's kubeinfer_qk_qlinear and kubeinfer_qk_dequant (see KI_BITS_KQUANT); null
// leaves such descriptors refused (return code 3). Set once at load, not thread-safe against running kernels.
void kubeinfer_qlinear_set_kquant(KiKQuantLinearFn linear, KiKQuantDequantFn dequant) {
  kquant_linear = linear;
  kquant_dequant = dequant;
}

// Whether the AVX-512 path may run (the usable-feature probe's answer; off until called). Not
// thread-safe against running kernels: set once at load.
void kubeinfer_qlinear_set_avx512(int32_t allowed) { avx512_allowed = allowed != 0; }

// Whether the bf16 batched path may run for descriptors that ask for it (the usable-feature probe's
// avx512_bf16; off until called). Not thread-safe against running kernels: set once at load.
void kubeinfer_qlinear_set_bf16(int32_t allowed) { bf16_allowed = allowed != 0; }

// 1 when the bf16 batched path is compiled into this build; kubeinfer_qlinear_bf16_enabled: and runs here.
int32_t kubeinfer_qlinear_has_bf16_path() { return KI_BF16_PATH; }
int32_t kubeinfer_qlinear_bf16_enabled() { return bf16_enabled() ? 1 : 0; }

// Sets the largest M served by the GEMV path, for fp32 and for bf16 compute (benchmarks only: not
// thread-safe against running kernels).
void kubeinfer_qlinear_set_gemv_max_rows(int64_t rows, int64_t bf16_rows) {
  gemv_max_rows = std::max<int64_t>(rows, 1);
  bf16_gemv_max_rows = std::max<int64_t>(bf16_rows, 1);
}

// The code path the batched kernel runs on this CPU: "avx512" (chosen at run time), "avx2" or "portable".
const char* kubeinfer_qlinear_isa() { return avx512_enabled() ? "avx512" : KI_AVX2 ? "avx2" : "portable"; }

// 1 when the AVX-512 code path is compiled into this build (whether or not this CPU can run it).
int32_t kubeinfer_qlinear_has_avx512_path() { return KI_AVX512_PATH; }

// y[i * y_stride + n] = sum_k x[i * x_stride + k] * W[n, k] (+ bias[n]) for i < m, n < w->n.
int32_t kubeinfer_qlinear(const KiQWeight* w, const float* x, int64_t m, int64_t x_stride, const float* bias,
                          float* y, int64_t y_stride, int32_t nthreads) {
  if (w && w->bits == KI_BITS_KQUANT)
    return kquant_linear ? kquant_linear(w, x, m, x_stride, bias, y, y_stride, nthreads) : 3;
  return dispatch(w, [&]<int BITS, bool F16>() {
    qlinear<BITS, F16>(*w, x, m, x_stride, bias, y, y_stride, std::max(nthreads, 1));
  });
}

// out[i * out_stride + k] = bf16(W[row0 + i, k]) for i < nrows, k < w->k, rounded to nearest even (the
// values of kubeinfer_qdequant, rounded as torch's .bfloat16()). 2 where this build or CPU has no bf16
// path (bf16_enabled) or W's groups are not whole 32-blocks: the caller dequantizes to fp32 instead.
int32_t kubeinfer_qdequant_bf16(const KiQWeight* w, int64_t row0, int64_t nrows, uint16_t* out, int64_t out_stride,
                                int32_t nthreads) {
  if (w && w->bits == KI_BITS_KQUANT) return 2;  // fp32 instead (kubeinfer_qdequant)
  if (!valid(w)) return 1;
  if (!bf16_enabled() || w->k % 32 || w->group_size % 32) return 2;
  return dispatch(w, [&]<int BITS, bool F16>() {
    dequant_bf16<BITS, F16>(*w, row0, nrows, out, out_stride, std::max(nthreads, 1));
  });
}

// out[i * out_stride + k] = W[rows ? rows[i] : row0 + i, k] for i < nrows, k < w->k.
int32_t kubeinfer_qdequant(const KiQWeight* w, const int64_t* rows, int64_t row0, int64_t nrows, float* out,
                           int64_t out_stride, int32_t nthreads) {
  if (w && w->bits == KI_BITS_KQUANT)
    return kquant_dequant ? kquant_dequant(w, rows, row0, nrows, out, out_stride, nthreads) : 3;
  return dispatch(w, [&]<int BITS, bool F16>() {
    dequant<BITS, F16>(*w, rows, row0, nrows, out, out_stride, std::max(nthreads, 1));
  });
}
}
