// Paged decode attention for CPU: one query token per sequence, each K/V row of the paged cache read once.
//
// Built at run time by server/attention/cpu_kernel.py and called through ctypes, so it has a plain C ABI
// and includes no torch headers. Layouts:
//   q, out        [T, Hq, D]            rows[i] is the row of decode sequence i; rows may be strided
//                                       (q is often a view into the fused qkv projection); fp32 or bf16
//   k/v cache     [num_blocks, block_size, Hkv, D]      contiguous; fp32, bf16 or fp16 (any q dtype)
//   block_tables  [num_seqs, bt_stride] int32, seqs[i] is the row of decode sequence i
//   context_lens  [num_seqs] int32
// One task per part of a sequence's context (the whole context unless there are too few sequences to
// keep the threads busy): its blocks stream from memory once, each K/V row serving the G = Hq / Hkv
// query heads that share it. A second pass merges each sequence's parts (log-sum-exp rescaling).
// A bf16/fp16 cache row is widened to fp32 once (bf16: a 16-bit shift; fp16: F16C's vcvtph2ps, a
// portable bit conversion without it) and serves all G heads; scores, softmax and sums are fp32.
// AVX-512 builds: a part's V rows accumulate into registers (v_head_regs) and, over a bf16 cache where
// AVX512-BF16 is usable, its K rows feed vdpbf16ps as stored, q split into three bf16 parts that hold it
// exactly (scores16_bf16x3): the same values as widening up to the order of fp32 sums. Together ~40% less
// time where the context is in cache (a shared prefix; most of it the register sums, the bf16 K pass 7-15%),
// unchanged where memory bandwidth bounds it (benchmarks/cpu_attention.py).
// AVX2 builds (x86-64-v3): the same two passes in 8-lane registers (k_pass_avx2, v_run_regs8), the
// cache read in place. Other builds, and shapes the passes are not built for: the generic loops.
// OpenMP comes from the libgomp torch has already loaded (same soname), so it shares torch's threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// f(std::integral_constant<int, G>{}) for the G (query heads per KV head) the register passes are built
// for, 1..8; false for any other G (the caller then runs the generic loop).
template <typename F>
bool with_group_size(int G, F&& f) {
  switch (G) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return false;
  }
}

using bf16 = uint16_t;
struct fp16 {  // IEEE binary16 bits, a distinct type from bf16 for the templates
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float to_float(fp16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  // binary16 -> binary32, exact (subnormals normalized, inf/NaN kept)
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu, man = x.bits & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (!man) {
    bits = sign;
  } else {
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400u));
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}
// An int8 cache's value before its group's scale (widen_row_s and the scalar tails apply it).
inline float to_float(int8_t x) { return static_cast<float>(x); }

inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, fp16* dst) {
#if defined(__F16C__)
  dst->bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
  // binary32 -> binary16, round to nearest even (as torch's conversion and F16C): handles overflow to
  // inf, subnormal results and NaN.
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) {
    dst->bits = sign | 0x7e00u;
    return;
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: inf
    dst->bits = sign | 0x7c00u;
    return;
  }
  if (abs < 0x38800000u) {  // below 2^-14: a subnormal (or zero) half
    if (abs < 0x33000000u) {  // below half the smallest subnormal (2^-25): zero
      dst->bits = sign;
      return;
    }
    const uint32_t e = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // man >> (shift) is the subnormal's 10-bit mantissa
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    dst->bits = sign | static_cast<uint16_t>(h);
    return;
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  dst->bits = sign | static_cast<uint16_t>(h);
#endif
}
inline void from_float(float x, bf16* dst) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN (quiet)
    *dst = static_cast<bf16>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
  *dst = static_cast<bf16>(bits >> 16);
}

// dst[0..n) = src widened to fp32: vectorized where the build has the instructions, else scalar.
inline void widen_row(const float* src, float* dst, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen_row(const bf16* src, float* dst, int n) {
  int j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
    _mm512_storeu_ps(dst + j, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#elif defined(__AVX2__)
  for (; j + 8 <= n; j += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j)));
    _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; j < n; ++j) dst[j] = to_float(src[j]);
}
inline void widen_row(const fp16* src, float* dst, int n) {
  int j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))));
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
#endif
  for (; j < n; ++j) dst[j] = to_float(src[j]);
}

// ---- int8 caches (server/attention/int8_kv.py) ----
// A block holds block_size * Hkv rows of D int8 values, then their scales: fp32 [block_size][Hkv][D / 32],
// one per 32 consecutive values of a row (value = q * scale). Each load below takes the row's scales
// (`rs`, nullptr for a float cache, whose loads ignore it) and the column it starts at.
constexpr int kI8Group = 32;
inline int64_t int8_block_elems(int block_size, int hkv, int d) {
  return static_cast<int64_t>(block_size) * hkv * (d + static_cast<int>(sizeof(float)) * (d / kI8Group));
}
template <typename C>
inline const float* row_scales(const C*, int, int, int, int, int) {
  return nullptr;
}
// `block` is the block's first byte, (off, h) the row's token in the block and KV head.
template <>
inline const float* row_scales(const int8_t* block, int off, int h, int BS, int HKV, int D) {
  return reinterpret_cast<const float*>(block + static_cast<int64_t>(BS) * HKV * D) +
         (static_cast<int64_t>(off) * HKV + h) * (D / kI8Group);
}
// How far the next token's row's scales are from this row's (0 for a float cache: rs stays nullptr).
template <typename C>
inline int64_t row_scales_step(int HKV, int D) {
  return std::is_same_v<C, int8_t> ? static_cast<int64_t>(HKV) * (D / kI8Group) : 0;
}

template <typename C>
inline void widen_row_s(const C* src, const float*, float* dst, int n) {
  widen_row(src, dst, n);
}
inline void widen_row_s(const int8_t* src, const float* rs, float* dst, int n) {
  int j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
    _mm512_storeu_ps(dst + j, _mm512_mul_ps(x, _mm512_set1_ps(rs[j / kI8Group])));
  }
#elif defined(__AVX2__)
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j))));
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(x, _mm256_set1_ps(rs[j / kI8Group])));
  }
#endif
  for (; j < n; ++j) dst[j] = to_float(src[j]) * rs[j / kI8Group];
}

#if defined(__AVX512F__)
// The 16 horizontal sums of v[0..15], lane i = sum of v[i]'s lanes: a transpose-and-add tree of 15 adds
// and 30 shuffles, where 16 separate reductions cost ~8 dependent ops each.
inline __m512 reduce16(const __m512* v) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane L: the lane-L partial sums of v[4i..4i+3]
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The scores of m <= 16 consecutive tokens for one KV head's G query heads: kb holds the 16 widened K
// rows (those past m zero), 16 dot products accumulate side by side and reduce16 sums them together.
// D is a multiple of 16.
inline void scores16(const float* kb, int m, int D, int G, const float* qh0, float* out, int64_t out_stride) {
  const __mmask16 keep = static_cast<__mmask16>(m == 16 ? 0xffffu : (1u << m) - 1u);
  for (int g = 0; g < G; ++g) {
    const float* qh = qh0 + g * D;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 16) {
      const __m512 qv = _mm512_loadu_ps(qh + j);
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) acc[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kb + u * D + j), acc[u]);
    }
    _mm512_mask_storeu_ps(out + g * out_stride, keep, reduce16(acc));
  }
}
#endif

#if defined(__AVX512F__)
// 16 consecutive elements of a cache row widened to fp32 in a register (bf16: a 16-bit shift).
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16(const bf16* src) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const fp16* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
inline __m512 load16(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
// load16 of the row's columns [col, col + 16), dequantized for an int8 cache (16 columns lie in one group).
template <typename C>
inline __m512 load16s(const C* src, const float*, int) {
  return load16(src);
}
inline __m512 load16s(const int8_t* src, const float* rs, int col) {
  return _mm512_mul_ps(load16(src), _mm512_set1_ps(rs[col / kI8Group]));
}

// The V pass of one KV head over columns [16 j0, 16 (j0 + JB)) of its G query heads:
// acc[g][j] = sum_t p[g][t] * V[t][j], the G * JB sums held in registers for the whole part (the
// memory-held accumulator of the generic pass loads and stores every sum once per token). Each sum
// adds the tokens in order, as the generic pass does, so both give the same values.
template <int G, int JB, typename C>
void v_head_regs(const C* vc, const int32_t* table, int64_t block_elems, int BS, int HKV, int D, int h, int j0,
                 int t_begin, int t_end, const float* p, int64_t n_tok, float* acc) {
  __m512 r[G * JB];
#pragma GCC unroll 32
  for (int i = 0; i < G * JB; ++i) r[i] = _mm512_setzero_ps();
  const int64_t rs_step = row_scales_step<C>(HKV, D);
  for (int t = t_begin; t < t_end;) {
    const int off = t % BS, n = std::min(BS - off, t_end - t);
    const C* block = vc + table[t / BS] * block_elems;
    const C* row = block + (static_cast<int64_t>(off) * HKV + h) * D + 16 * j0;
    const float* rs = row_scales(block, off, h, BS, HKV, D);
    const float* pt = p + (t - t_begin);
    for (int u = 0; u < n; ++u, row += static_cast<int64_t>(HKV) * D, rs += rs_step) {
      __m512 v[JB];
#pragma GCC unroll 8
      for (int j = 0; j < JB; ++j) v[j] = load16s(row + 16 * j, rs, 16 * (j0 + j));
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(pt[g * n_tok + u]);
#pragma GCC unroll 8
        for (int j = 0; j < JB; ++j) r[g * JB + j] = _mm512_fmadd_ps(pg, v[j], r[g * JB + j]);
      }
    }
    t += n;
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < JB; ++j) _mm512_storeu_ps(acc + g * D + 16 * (j0 + j), r[g * JB + j]);
}

// Columns per pass: the most (of 8, 4, 2, 1, dividing D / 16) that keep G * JB sums, JB rows and G
// broadcasts within the 32 zmm registers.
inline int v_block_cols(int G, int D) {
  const int J = D / 16;
  for (int jb : {8, 4, 2, 1})
    if (J % jb == 0 && G * jb + jb + G <= 30) return jb;
  return 0;
}

template <typename C, int G>
bool v_pass_regs_g(const C* vc, const int32_t* table, int64_t block_elems, int BS, int HKV, int D, int jb,
                   int t_begin, int t_end, const float* scores, int64_t n_tok, float* acc) {
  using Fn = void (*)(const C*, const int32_t*, int64_t, int, int, int, int, int, int, int, const float*, int64_t,
                      float*);
  Fn f = nullptr;
  switch (jb) {
    case 8: f = v_head_regs<G, (G * 8 + 8 + G <= 30 ? 8 : 1), C>; break;
    case 4: f = v_head_regs<G, (G * 4 + 4 + G <= 30 ? 4 : 1), C>; break;
    case 2: f = v_head_regs<G, (G * 2 + 2 + G <= 30 ? 2 : 1), C>; break;
    default: f = v_head_regs<G, 1, C>; break;
  }
  for (int h = 0; h < HKV; ++h)
    for (int j0 = 0; j0 < D / 16; j0 += jb)
      f(vc, table, block_elems, BS, HKV, D, h, j0, t_begin, t_end, scores + static_cast<int64_t>(h * G) * n_tok,
        n_tok, acc + static_cast<int64_t>(h * G) * D);
  return true;
}

// The register V pass where G (query heads per KV head) is one it is built for; false: use the generic.
template <typename C>
bool v_pass_regs(const C* vc, const int32_t* table, int64_t block_elems, int BS, int HKV, int G, int D,
                 int t_begin, int t_end, const float* scores, int64_t n_tok, float* acc) {
  if (D % 16 != 0) return false;
  const int jb = v_block_cols(G, D);
  if (jb == 0) return false;
  return with_group_size(G, [&](auto g) {
    return v_pass_regs_g<C, decltype(g)::value>(vc, table, block_elems, BS, HKV, D, jb, t_begin, t_end, scores,
                                                n_tok, acc);
  });
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && !defined(KI_GENERIC_DECODE)
// AVX2 builds (x86-64-v3, an AVX2-only CPU): the same two passes in 8-lane registers. Before them such a
// build ran the generic loops: a K row copied per token and one horizontal sum per (token, query head),
// and the V sums loaded and stored per token; 32 decodes over 640-token contexts took ~97 ms of a ~190 ms
// step on an AVX2-only AMD EPYC (benchmarks/cpu_attention.py `decode_fp32`, which builds the loops back
// with -DKI_GENERIC_DECODE to compare).
#define KI_AVX2_PATH 1

// 8 consecutive elements of a cache row widened to fp32 in a register (bf16: a 16-bit shift).
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const bf16* src) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const fp16* src) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = to_float(src[i]);
  return _mm256_load_ps(f);
#endif
}
inline __m256 load8(const int8_t* src) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
}
template <typename C>
inline __m256 load8s(const C* src, const float*, int) {
  return load8(src);
}
inline __m256 load8s(const int8_t* src, const float* rs, int col) {
  return _mm256_mul_ps(load8(src), _mm256_set1_ps(rs[col / kI8Group]));
}

// Asks for the next block while this one is computed: a sequence's blocks lie anywhere in the cache, so
// the hardware prefetcher, which follows addresses, cannot know where the next one is.
template <typename C>
inline void prefetch_block(const C* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(C));
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// The 8 horizontal sums of v[0..7], lane i = sum of v[i]'s lanes: two rounds of hadd and one cross-lane
// add, where 8 separate reductions cost ~4 dependent ops each.
inline __m256 reduce8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 low | v0..v3 high] sums
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The K pass of one part (scores[hq][t - t_begin] for every query head), tokens 8 at a time read in place
// from the cache: per query head 8 dot products side by side, one reduce8. D is a multiple of 8.
template <typename C>
void k_pass_avx2(const C* kc, const int32_t* table, int64_t block_elems, int BS, int HKV, int G, int D,
                 int t_begin, int t_end, const float* qf, float* scores, int64_t n_tok) {
  alignas(32) static const C zero_row[512] = {};  // head_dim <= 512, checked by the launcher
  static const float zero_scales[512 / kI8Group] = {};
  const C* rows[8];
  const float* rss[8];
  for (int t = t_begin; t < t_end;) {
    const int off = t % BS, n = std::min(BS - off, t_end - t);
    const C* block = kc + table[t / BS] * block_elems;
    for (int u0 = 0; u0 < n; u0 += 8) {
      const int m = std::min(8, n - u0);
      for (int h = 0; h < HKV; ++h) {
        for (int u = 0; u < 8; ++u) {
          rows[u] = u < m ? block + (static_cast<int64_t>(off + u0 + u) * HKV + h) * D : zero_row;
          rss[u] = u < m ? row_scales(block, off + u0 + u, h, BS, HKV, D) : zero_scales;
        }
        for (int g = 0; g < G; ++g) {
          const float* qh = qf + static_cast<int64_t>(h * G + g) * D;
          __m256 acc[8];
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
          for (int j = 0; j < D; j += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + j);
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, load8s(rows[u] + j, rss[u], j), acc[u]);
          }
          float* dst = scores + static_cast<int64_t>(h * G + g) * n_tok + (t - t_begin) + u0;
          const __m256 sum = reduce8(acc);
          if (m == 8) {
            _mm256_storeu_ps(dst, sum);
          } else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, sum);
            std::copy(tmp, tmp + m, dst);
          }
        }
      }
    }
    t += n;
  }
}

// The V pass over one run of n consecutive tokens of a block (rows row0 + u * row_stride) for one KV
// head's G query heads and columns [8 j0, 8 (j0 + JB)): the G * JB sums come from acc, take the run's
// tokens in order (as the generic pass adds them) and go back. A run is at most a block (a few KB for
// every head), so the passes over its columns and heads after the first find it in L1.
template <int G, int JB, typename C>
inline void v_run_regs8(const C* row0, const float* rs0, int col0, int n, int64_t row_stride, int64_t rs_step,
                        const float* pt, int64_t n_tok, float* acc, int D) {
  __m256 r[G * JB];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < JB; ++j) r[g * JB + j] = _mm256_loadu_ps(acc + g * D + 8 * j);
  const C* row = row0;
  const float* rs = rs0;
  for (int u = 0; u < n; ++u, row += row_stride, rs += rs_step) {
    __m256 v[JB];
#pragma GCC unroll 4
    for (int j = 0; j < JB; ++j) v[j] = load8s(row + 8 * j, rs, col0 + 8 * j);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m256 pg = _mm256_broadcast_ss(pt + g * n_tok + u);
#pragma GCC unroll 4
      for (int j = 0; j < JB; ++j) r[g * JB + j] = _mm256_fmadd_ps(pg, v[j], r[g * JB + j]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < JB; ++j) _mm256_storeu_ps(acc + g * D + 8 * j, r[g * JB + j]);
}

// Columns per pass: the most (of 4, 2, 1, dividing D / 8) that keep G * JB sums, JB rows and one
// broadcast within the 16 ymm registers.
inline int v_block_cols8(int G, int D) {
  const int J = D / 8;
  for (int jb : {4, 2, 1})
    if (J % jb == 0 && G * jb + jb + 1 <= 16) return jb;
  return 0;
}

template <typename C, int G>
bool v_pass_regs8_g(const C* vc, const int32_t* table, int64_t block_elems, int BS, int HKV, int D, int jb,
                    int t_begin, int t_end, const float* scores, int64_t n_tok, float* acc) {
  using Fn = void (*)(const C*, const float*, int, int, int64_t, int64_t, const float*, int64_t, float*, int);
  Fn f = nullptr;
  switch (jb) {
    case 4: f = v_run_regs8<G, (G * 4 + 4 + 1 <= 16 ? 4 : 1), C>; break;
    case 2: f = v_run_regs8<G, (G * 2 + 2 + 1 <= 16 ? 2 : 1), C>; break;
    default: f = v_run_regs8<G, 1, C>; break;
  }
  const int64_t row_stride = static_cast<int64_t>(HKV) * D, rs_step = row_scales_step<C>(HKV, D);
  for (int t = t_begin; t < t_end;) {
    const int off = t % BS, n = std::min(BS - off, t_end - t);
    const C* block0 = vc + table[t / BS] * block_elems;
    const C* block = block0 + static_cast<int64_t>(off) * row_stride;
    for (int h = 0; h < HKV; ++h)
      for (int j0 = 0; j0 < D / 8; j0 += jb)
        f(block + static_cast<int64_t>(h) * D + 8 * j0, row_scales(block0, off, h, BS, HKV, D), 8 * j0, n,
          row_stride, rs_step, scores + static_cast<int64_t>(h * G) * n_tok + (t - t_begin), n_tok,
          acc + static_cast<int64_t>(h * G) * D + 8 * j0, D);
    t += n;
  }
  return true;
}

// The register V pass where G (query heads per KV head) is one it is built for; false: use the generic.
template <typename C>
bool v_pass_regs8(const C* vc, const int32_t* table, int64_t block_elems, int BS, int HKV, int G, int D,
                  int t_begin, int t_end, const float* scores, int64_t n_tok, float* acc) {
  if (D % 8 != 0) return false;
  const int jb = v_block_cols8(G, D);
  if (jb == 0) return false;
  return with_group_size(G, [&](auto g) {
    return v_pass_regs8_g<C, decltype(g)::value>(vc, table, block_elems, BS, HKV, D, jb, t_begin, t_end, scores,
                                                 n_tok, acc);
  });
}
#endif

#if defined(__AVX512F__)
// The bf16 K pass is compiled into every AVX-512 build through a target attribute (the images' prebuilt
// x86-64-v4 level does not include AVX512-BF16) and chosen at run time only where bf16_enabled(): the CPU
// has it and Python allows it (usable_cpu_features: the OS state, KUBEINFER_CPU_DISABLE).
#define KI_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
bool bf16_allowed = false;
bool bf16_enabled() {
  static const bool on = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return on && bf16_allowed;
}

// scores16 for a bf16 cache without widening it: the K rows are vdpbf16ps operands as stored, and each
// query head is the sum of three bf16 vectors (hi = q rounded to bf16, mid = the remainder rounded, lo =
// what is left rounded), which hold fp32 q exactly (3 x 8 mantissa bits; a bf16 q alone would keep 8), so
// q . k = hi . k + mid . k + lo . k with every product exact in fp32: only the order of the fp32 sums
// differs from the widening path. rows[u] (u < 16) is token u's row of this KV head (a zero row past m);
// D is a multiple of 32; qs holds per query head its hi, mid and lo words (D / 2 each).
KI_BF16_TARGET inline void scores16_bf16x3(const bf16* const* rows, int m, int D, int G, const uint32_t* qs, float* out,
                            int64_t out_stride) {
  const __mmask16 keep = static_cast<__mmask16>(m == 16 ? 0xffffu : (1u << m) - 1u);
  const int W = D / 2;  // 32-bit words (bf16 pairs) per row
  for (int g = 0; g < G; ++g) {
    const uint32_t* hi = qs + 3 * g * W;
    const uint32_t* mid = hi + W;
    const uint32_t* lo = mid + W;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 32) {
      const __m512bh qh = (__m512bh)_mm512_loadu_si512(hi + j / 2);
      const __m512bh qm = (__m512bh)_mm512_loadu_si512(mid + j / 2);
      const __m512bh ql = (__m512bh)_mm512_loadu_si512(lo + j / 2);
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(rows[u] + j);
        acc[u] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[u], ql, k), qm, k), qh, k);
      }
    }
    _mm512_mask_storeu_ps(out + g * out_stride, keep, reduce16(acc));
  }
}


// The K pass of one part over a bf16 cache (scores[hq][t - t_begin] for every query head), scores16_bf16x3
// on 16 tokens at a time. qf [Hq, D] is the scaled query in fp32; D is a multiple of 32.
KI_BF16_TARGET void k_pass_bf16x3(const bf16* kc, const int32_t* table, int64_t block_elems, int BS, int HKV, int G,
                                  int D, int t_begin, int t_end, const float* qf, float* scores, int64_t n_tok) {
  const int HQ = HKV * G, W = D / 2;
  // per query head: its hi, mid and lo words
  thread_local std::vector<uint32_t> qs;
  qs.resize(static_cast<size_t>(HQ) * 3 * W);
  for (int hh = 0; hh < HQ; ++hh) {
    bf16* hi = reinterpret_cast<bf16*>(qs.data() + static_cast<size_t>(hh) * 3 * W);
    for (int j = 0; j < D; j += 16) {  // vcvtneps2bf16 rounds to nearest even, as from_float
      const __m512 x = _mm512_loadu_ps(qf + hh * D + j);
      const __m256bh h16 = _mm512_cvtneps_pbh(x);
      const __m512 r = _mm512_sub_ps(x, _mm512_cvtpbh_ps(h16));
      const __m256bh m16 = _mm512_cvtneps_pbh(r);
      const __m256bh l16 = _mm512_cvtneps_pbh(_mm512_sub_ps(r, _mm512_cvtpbh_ps(m16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j), (__m256i)h16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + D + j), (__m256i)m16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + 2 * D + j), (__m256i)l16);
    }
  }
  alignas(64) static const bf16 zero_row[512] = {};  // head_dim <= 512, checked by the launcher
  const bf16* rows[16];
  for (int t = t_begin; t < t_end;) {
    const int off = t % BS, n = std::min(BS - off, t_end - t);
    const bf16* block = kc + table[t / BS] * block_elems;
    for (int u0 = 0; u0 < n; u0 += 16) {
      const int mm = std::min(16, n - u0);
      for (int h = 0; h < HKV; ++h) {
        for (int u = 0; u < 16; ++u)
          rows[u] = u < mm ? block + (static_cast<int64_t>(off + u0 + u) * HKV + h) * D : zero_row;
        scores16_bf16x3(rows, mm, D, G, qs.data() + static_cast<size_t>(h * G) * 3 * W,
                        scores + static_cast<int64_t>(h * G) * n_tok + (t - t_begin) + u0, n_tok);
      }
    }
    t += n;
  }
}
#endif

struct Args {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int64_t* seqs;
  const int64_t* rows;
  int64_t num_decode;
  int64_t q_row_stride, out_row_stride, bt_stride;
  int32_t hq, hkv, d, block_size;
  float scale;
  int32_t window;  // sliding window W: the query at position p sees keys p - W + 1 .. p; 0 = the whole context
  // [Hq] fp32 or nullptr: gpt-oss's attention sinks, one learned logit per query head that joins each
  // softmax's denominator (no value row): out = sum_t exp(s_t) v_t / (sum_t exp(s_t) + exp(sink))
  const float* sinks;
  // 0, or Gemma 2's attention logit soft-cap: each scaled score s becomes cap * tanh(s / cap) before the
  // window and softmax (transformers' Gemma 2 eager attention, vLLM's logits_soft_cap)
  float softcap;
  // One cache block's elements: block_size * Hkv * D, and for an int8 cache its rows' scales after them
  // (int8_block_elems).
  int64_t block_elems;
};

// The first position a query at position ctx - 1 sees: ctx - W under a window W (Mistral's, Gemma's:
// transformers' sliding_window_overlay keeps kv_idx > q_idx - W), else 0.
inline int window_start(int ctx, int window) { return window > 0 && ctx > window ? ctx - window : 0; }

// One slice of one sequence's context: tokens [t_begin, t_end), whole blocks except at the end.
struct Part {
  int64_t i;  // decode sequence
  int t_begin, t_end;
};

// Calls f(t, h, row, rs) for every K or V row of the part: t its position in the part, h its KV head, rs
// the row's scales (row_scales).
// Blocks are walked in order and each is read front to back, so the part streams from memory.
template <typename T, typename F>
inline void for_each_row(const Args& a, const Part& part, const int32_t* table, const T* cache, F&& f) {
  const int HKV = a.hkv, D = a.d, BS = a.block_size;
  const int64_t block_elems = a.block_elems;
  for (int t = part.t_begin; t < part.t_end;) {
    const int off = t % BS, n = std::min(BS - off, part.t_end - t);
    const T* block = cache + table[t / BS] * block_elems;
    for (int u = 0; u < n; ++u)
      for (int h = 0; h < HKV; ++h)
        f(t - part.t_begin + u, h, block + (static_cast<int64_t>(off + u) * HKV + h) * D,
          row_scales(block, off + u, h, BS, HKV, D));
    t += n;
  }
}

// Attends one part for every query head; leaves in m/l/acc (each [Hq] or [Hq, D]) the part's score max,
// its sum of exp(score - max) and the matching unnormalized sum of V rows.
template <typename T, typename C>
void attend_part(const Args& a, const Part& part, std::vector<float>& scores, std::vector<float>& qf,
                 float* m_out, float* l_out, float* acc) {
  const int HQ = a.hq, G = HQ / a.hkv, D = a.d;
  const int64_t seq = a.seqs[part.i], row = a.rows[part.i];
  const int n_tok = part.t_end - part.t_begin;
  const int32_t* table = a.block_tables + seq * a.bt_stride;
  const T* q = static_cast<const T*>(a.q) + row * a.q_row_stride;
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  float row_f[512];  // one K or V row widened to fp32 (head_dim <= 512, checked by the launcher)
  // scores[hq][t - t_begin]: every query head's score of every position in the part
  scores.resize(static_cast<size_t>(HQ) * n_tok);
  qf.resize(static_cast<size_t>(HQ) * D);
  for (int j = 0; j < HQ * D; ++j) qf[j] = to_float(q[j]) * a.scale;
  std::fill(acc, acc + static_cast<size_t>(HQ) * D, 0.0f);

#if defined(__AVX512F__)
  if constexpr (std::is_same_v<C, bf16>) {
    if (D % 32 == 0 && bf16_enabled()) {
      k_pass_bf16x3(kc, table, a.block_elems, a.block_size, a.hkv, G, D,
                    part.t_begin, part.t_end, qf.data(), scores.data(), n_tok);
      goto k_done;
    }
  }
#endif
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    // Tokens 16 at a time (scores16): one reduction tree per 16 scores instead of one horizontal sum
    // per (token, query head). The 16 tokens' rows are widened in memory order (the cache streams as
    // before) into kb [Hkv][16][D].
    thread_local std::vector<float> kb;
    const int HKV = a.hkv, BS = a.block_size;
    kb.assign(static_cast<size_t>(HKV) * 16 * D, 0.0f);
    const int64_t block_elems = a.block_elems;
    for (int t = part.t_begin; t < part.t_end;) {
      const int off = t % BS, n = std::min(BS - off, part.t_end - t);
      const C* block = kc + table[t / BS] * block_elems;
      for (int u0 = 0; u0 < n; u0 += 16) {
        const int m = std::min(16, n - u0);
        const C* rows = block + static_cast<int64_t>(off + u0) * HKV * D;
        for (int u = 0; u < m; ++u)
          for (int h = 0; h < HKV; ++h)
            widen_row_s(rows + (u * HKV + h) * D, row_scales(block, off + u0 + u, h, BS, HKV, D),
                        kb.data() + (h * 16 + u) * D, D);
        if (m < 16)  // rows past m: zero, so their (masked-off) sums stay finite
          for (int h = 0; h < HKV; ++h) std::fill(kb.data() + (h * 16 + m) * D, kb.data() + (h * 16 + 16) * D, 0.0f);
        for (int h = 0; h < HKV; ++h)
          scores16(kb.data() + h * 16 * D, m, D, G, qf.data() + h * G * D,
                   scores.data() + static_cast<size_t>(h * G) * n_tok + (t - part.t_begin) + u0, n_tok);
      }
      t += n;
    }
  } else
#endif
#if defined(KI_AVX2_PATH)
  if (D % 8 == 0) {
    k_pass_avx2(kc, table, a.block_elems, a.block_size, a.hkv, G, D, part.t_begin,
                part.t_end, qf.data(), scores.data(), n_tok);
  } else
#endif
  for_each_row(a, part, table, kc, [&](int t, int h, const C* kr, const float* rs) {
    widen_row_s(kr, rs, row_f, D);
    for (int g = 0; g < G; ++g) {
      const float* qh = qf.data() + (h * G + g) * D;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int j = 0; j < D; ++j) s += qh[j] * row_f[j];
      scores[static_cast<size_t>(h * G + g) * n_tok + t] = s;
    }
  });

#if defined(__AVX512F__)
k_done:
#endif
  if (a.softcap > 0.0f) {
    const float cap = a.softcap, inv_cap = 1.0f / cap;
    float* s = scores.data();
    const size_t count = static_cast<size_t>(HQ) * n_tok;
    for (size_t j = 0; j < count; ++j) s[j] = cap * std::tanh(s[j] * inv_cap);
  }
  for (int hh = 0; hh < HQ; ++hh) {
    float* s = scores.data() + static_cast<size_t>(hh) * n_tok;
    float m = s[0];
    for (int t = 1; t < n_tok; ++t) m = std::max(m, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n_tok; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    m_out[hh] = m;
    l_out[hh] = sum;
  }

#if defined(__AVX512F__)
  if (v_pass_regs<C>(vc, table, a.block_elems, a.block_size, a.hkv, G, D,
                     part.t_begin, part.t_end, scores.data(), n_tok, acc))
    return;
#endif
#if defined(KI_AVX2_PATH)
  if (v_pass_regs8<C>(vc, table, a.block_elems, a.block_size, a.hkv, G, D,
                      part.t_begin, part.t_end, scores.data(), n_tok, acc))
    return;
#endif
  for_each_row(a, part, table, vc, [&](int t, int h, const C* vr, const float* rs) {
    widen_row_s(vr, rs, row_f, D);
    for (int g = 0; g < G; ++g) {
      const float p = scores[static_cast<size_t>(h * G + g) * n_tok + t];
      float* ah = acc + (h * G + g) * D;
#pragma omp simd
      for (int j = 0; j < D; ++j) ah[j] += p * row_f[j];
    }
  });
}

// Tokens per part: whole sequences while there are enough of them to keep every thread busy; with few
// sequences (one user, long context) their contexts are cut into slices of whole blocks, at least
// kMinPartTokens long so that the combine pass stays negligible.
constexpr int kMinPartTokens = 256;

std::vector<Part> make_parts(const Args& a, int num_threads) {
  int64_t total_blocks = 0;
  for (int64_t i = 0; i < a.num_decode; ++i) {
    const int ctx = a.context_lens[a.seqs[i]];
    total_blocks += (ctx - window_start(ctx, a.window) + a.block_size - 1) / a.block_size;
  }
  const int64_t target_tasks = 4 * static_cast<int64_t>(std::max(num_threads, 1));
  const int64_t min_blocks = std::max<int64_t>(1, kMinPartTokens / a.block_size);
  const int64_t part_blocks = std::max(min_blocks, (total_blocks + target_tasks - 1) / target_tasks);
  const int64_t part_tokens = part_blocks * a.block_size;
  std::vector<Part> parts;
  for (int64_t i = 0; i < a.num_decode; ++i) {
    const int ctx = a.context_lens[a.seqs[i]];
    // under a window only its last W positions: parts start there (the passes take any start in a block)
    for (int64_t t = window_start(ctx, a.window); t < ctx; t += part_tokens)
      parts.push_back({i, static_cast<int>(t), static_cast<int>(std::min<int64_t>(ctx, t + part_tokens))});
  }
  return parts;
}

template <typename T, typename C>
void run(const Args& a, int num_threads) {
  const int HQ = a.hq, D = a.d;
  const std::vector<Part> parts = make_parts(a, num_threads);
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  std::vector<float> m(num_parts * HQ), l(num_parts * HQ), acc(num_parts * HQ * D);
  // first_part[i]..first_part[i + 1]: the parts of sequence i (parts are in sequence order)
  std::vector<int64_t> first_part(a.num_decode + 1, num_parts);
  for (int64_t p = num_parts - 1; p >= 0; --p) first_part[parts[p].i] = p;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, qf;  // per thread, reused across its parts
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < num_parts; ++p)
      attend_part<T, C>(a, parts[p], scores, qf, &m[p * HQ], &l[p * HQ], &acc[p * HQ * D]);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < a.num_decode; ++i) {
      T* o = static_cast<T*>(a.out) + a.rows[i] * a.out_row_stride;
      const int64_t p0 = first_part[i], p1 = first_part[i + 1];
      for (int hh = 0; hh < HQ; ++hh) {
        float m_max = m[p0 * HQ + hh];
        for (int64_t p = p0 + 1; p < p1; ++p) m_max = std::max(m_max, m[p * HQ + hh]);
        // the sink is one more term of the denominator, under the same running max (no overflow)
        if (a.sinks) m_max = std::max(m_max, a.sinks[hh]);
        float denom = a.sinks ? std::exp(a.sinks[hh] - m_max) : 0.0f;
        float out[512];  // head_dim <= 512, checked by the launcher
        std::fill(out, out + D, 0.0f);
        for (int64_t p = p0; p < p1; ++p) {
          const float w = std::exp(m[p * HQ + hh] - m_max);
          denom += w * l[p * HQ + hh];
          const float* ap = &acc[(p * HQ + hh) * D];
#pragma omp simd
          for (int j = 0; j < D; ++j) out[j] += w * ap[j];
        }
        const float inv = 1.0f / denom;
        for (int j = 0; j < D; ++j) from_float(out[j] * inv, o + hh * D + j);
      }
    }
  }
}

#if defined(__AVX512F__)
// ---- prompt chunks over the paged cache (prefill attention), bf16 compute -------------------------
// One chunk: n query rows at positions [ctx - n, ctx) of one sequence, attending causally over its
// whole context [0, ctx), which the caller has already stored in the cache (its own K/V included).
// Flash-attention's online softmax (Dao et al. 2022, "FlashAttention", algorithm 1) over key blocks of
// 16 tokens, in bf16 products with fp32 sums (vdpbf16ps): q * scale and the probabilities P are rounded
// to bf16, K and V are the bf16 cache as stored; row maxima, exp, the running sums and the output are
// fp32. One task per (chunk, KV head): its context's K and V blocks are packed once into the layouts
// vdpbf16ps takes (K: [D/2 words][16 tokens]; V: [8 token pairs][D]) and serve every query row of the
// G query heads sharing that KV head, RG rows at a time with their D-wide sums in registers.

struct PrefillArgs {
  float* out;
  const float* q;
  const bf16* k_cache;
  const bf16* v_cache;
  const int32_t* block_tables;
  const int64_t* seqs;       // [C] row of block_tables
  const int64_t* q_starts;   // [C] first row of the chunk in q/out
  const int32_t* q_lens;     // [C] n
  const int32_t* ctx_lens;   // [C] ctx (cached prefix + n)
  int64_t num_chunks, q_row_stride, out_row_stride, bt_stride;
  int32_t hq, hkv, d, block_size;
  float scale;
  int32_t window;  // 0, or a sliding window W: the query at position p sees keys p - W + 1 .. p
  const float* sinks;  // [Hq] fp32 or nullptr: attention sinks (Args::sinks)
  float softcap;       // 0, or the attention logit soft-cap (Args::softcap)
};

// Finite stand-ins for -inf (the build's -ffast-math lets the compiler assume no infinities): a masked
// score, and the running max before the first block (key 0 is visible to every row, so the first block
// always has a real score above both).
constexpr float kMasked = 1e30f;
constexpr float kHuge = 3e38f;

// exp(x) for x <= 0 (x <= -87 -> exactly 0): 2^(x log2 e) as 2^n * p(r), p a degree-6 polynomial on
// r in [-0.5, 0.5] (relative error ~2e-7, below bf16's rounding of P).
KI_BF16_TARGET inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.0f * 0.69314718f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, n);  // 2^r, r in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512 y = _mm512_scalef_ps(p, n);
  // a masked score or far below: exactly 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), y);
}

// cap * tanh(x / cap) (Gemma 2's soft-cap; inv_cap = 1 / cap) as sign(y) (1 - e) / (1 + e), y = x / cap,
// e = exp(-2 |y|) <= 1 (exp512's range): no overflow; absolute error ~cap * 4e-7, below bf16's rounding of q.
KI_BF16_TARGET inline __m512 softcap512(__m512 x, float cap, float inv_cap) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(inv_cap));
  const __m512 ay = _mm512_abs_ps(y);
  const __m512 e = exp512(_mm512_mul_ps(ay, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));  // tanh(|y|)
  // the sign bit of y on cap * tanh(|y|)
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(_mm512_mul_ps(t, _mm512_set1_ps(cap))), sign));
}

// Packs tokens [16 b, 16 b + 16) of one KV head: kp[p * 16 + t] = K word p of token t (bf16 pair
// (k[2p], k[2p + 1])), vp[u * D + j] = (v[2u][j], v[2u + 1][j]) as one word; tokens past ctx are zero.
KI_BF16_TARGET void pack_block(const PrefillArgs& a, const int32_t* table, int h, int b, int ctx, uint32_t* kp,
                               uint32_t* vp) {
  const int D = a.d, W = D / 2, BS = a.block_size, HKV = a.hkv;
  const int64_t block_elems = static_cast<int64_t>(BS) * HKV * D;
  alignas(64) static const bf16 zero_row[512] = {};
  const bf16* krow[16];
  const bf16* vrow[16];
  for (int t = 0; t < 16; ++t) {
    const int pos = 16 * b + t;
    if (pos < ctx) {
      const int64_t off = table[pos / BS] * block_elems + (static_cast<int64_t>(pos % BS) * HKV + h) * D;
      krow[t] = a.k_cache + off;
      vrow[t] = a.v_cache + off;
    } else {
      krow[t] = vrow[t] = zero_row;
    }
  }
  for (int t = 0; t < 16; ++t) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(krow[t]);
    for (int p = 0; p < W; ++p) kp[p * 16 + t] = w[p];
  }
  // interleave rows 2u and 2u + 1 element by element: word j = (v[2u][j], v[2u + 1][j])
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                          22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int u = 0; u < 8; ++u) {
    for (int j = 0; j < D; j += 32) {
      const __m512i x = _mm512_loadu_si512(vrow[2 * u] + j);
      const __m512i y = _mm512_loadu_si512(vrow[2 * u + 1] + j);
      _mm512_storeu_si512(vp + u * D + j, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_storeu_si512(vp + u * D + j + 16, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
}

// RG query rows (DZ = D / 16 zmm of sums each) against the packed blocks [b0, nblocks) (kp/vp hold them
// from b0 on): rows r0 .. r0 + RG of the task's row order (query i = r / G, head g = r % G), qw their bf16
// words [rows][D/2], pos0 the position of query 0. Writes out rows normalized.
template <int DZ, int RG>
KI_BF16_TARGET void attend_rows(const PrefillArgs& a, const uint32_t* qw, const uint32_t* kp, const uint32_t* vp,
                                int b0, int r0, int nrows, int G, int pos0, int64_t q_start, int h, float* out) {
  constexpr int D = DZ * 16, W = D / 2;
  const float cap = a.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  __m512 acc[RG][DZ];
  __m512 lv[RG];  // per row: the running sum of exp(score - max), 16 lanes summed at the end
  float m[RG];
  int first[RG], last[RG];  // each row's first and last visible key
  for (int r = 0; r < RG; ++r) {
    for (int z = 0; z < DZ; ++z) acc[r][z] = _mm512_setzero_ps();
    m[r] = -kHuge;  // below any score: the first block sets it (corr = exp(-huge) = 0)
    lv[r] = _mm512_setzero_ps();
    last[r] = pos0 + (r < nrows ? (r0 + r) / G : (r0 + nrows - 1) / G);
    first[r] = a.window > 0 ? std::max(0, last[r] - a.window + 1) : 0;
  }
  int maxlast = last[0], minfirst = first[0];
  for (int r = 1; r < RG; ++r) maxlast = std::max(maxlast, last[r]), minfirst = std::min(minfirst, first[r]);
  const int nblocks = maxlast / 16 + 1;
  alignas(64) uint32_t pw[RG][8];
  for (int b = std::max(b0, minfirst / 16); b < nblocks; ++b) {
    const uint32_t* kb = kp + static_cast<int64_t>(b - b0) * W * 16;
    // two sums per row (even and odd words), so 2 * RG independent vdpbf16ps chains hide its latency
    __m512 s[RG], s1[RG];
    for (int r = 0; r < RG; ++r) s[r] = s1[r] = _mm512_setzero_ps();
    for (int p = 0; p < W; p += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * 16);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * 16 + 16);
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const uint32_t* qr = qw + (r0 + r) * W + p;
        s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[0])), k0);
        s1[r] = _mm512_dpbf16_ps(s1[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[1])), k1);
      }
    }
    for (int r = 0; r < RG; ++r) {
      s[r] = _mm512_add_ps(s[r], s1[r]);
      if (cap > 0.0f) s[r] = softcap512(s[r], cap, inv_cap);  // before the mask, as the reference
      // keys [lo, hi) of this block the row sees (causal: below last + 1; a window: from first on)
      const int lo = std::max(0, first[r] - 16 * b), hi = std::min(16, last[r] - 16 * b + 1);
      if (hi <= lo) {  // none: nothing to add (before the row's window, its running max is not set yet)
        std::fill(pw[r], pw[r] + 8, 0u);
        continue;
      }
      if (hi - lo < 16) {
        const __mmask16 keep = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
        s[r] = _mm512_mask_mov_ps(_mm512_set1_ps(-kMasked), keep, s[r]);
      }
      const float bm = _mm512_reduce_max_ps(s[r]);
      if (bm > m[r]) {  // a new running max: rescale what was summed under the old one (x 0 on the first block)
        const float corr = std::exp(m[r] - bm);
        const __m512 c = _mm512_set1_ps(corr);
        lv[r] = _mm512_mul_ps(lv[r], c);
        for (int z = 0; z < DZ; ++z) acc[r][z] = _mm512_mul_ps(acc[r][z], c);
        m[r] = bm;
      }
      const __m512 pr = exp512(_mm512_sub_ps(s[r], _mm512_set1_ps(m[r])));
      lv[r] = _mm512_add_ps(lv[r], pr);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw[r]), (__m256i)_mm512_cvtneps_pbh(pr));
    }
    const uint32_t* vb = vp + static_cast<int64_t>(b - b0) * 8 * D;
    for (int u = 0; u < 8; ++u) {
      __m512bh v[DZ];
      for (int z = 0; z < DZ; ++z) v[z] = (__m512bh)_mm512_loadu_si512(vb + u * D + 16 * z);
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][u]));
        for (int z = 0; z < DZ; ++z) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], pp, v[z]);
      }
    }
  }
  for (int r = 0; r < nrows; ++r) {
    const int row = r0 + r, i = row / G, g = row % G;
    float* o = out + (q_start + i) * a.out_row_stride + static_cast<int64_t>(h * G + g) * D;
    float l = _mm512_reduce_add_ps(lv[r]), c = 1.0f;
    if (a.sinks) {  // the sink joins the denominator: rescale to max(m, sink) so neither exp overflows
      const float sink = a.sinks[h * G + g], mm = std::max(m[r], sink);
      c = std::exp(m[r] - mm);
      l = l * c + std::exp(sink - mm);
    }
    const __m512 inv = _mm512_set1_ps(c / l);
    for (int z = 0; z < DZ; ++z) _mm512_storeu_ps(o + 16 * z, _mm512_mul_ps(acc[r][z], inv));
  }
}

// Queries [i0, i1) of chunk c for KV head h: packs the keys they see ([0, ctx - n + i1), under a window
// from the first query's window start) and attends.
KI_BF16_TARGET void prefill_task(const PrefillArgs& a, int64_t c, int h, int i0, int i1, std::vector<uint32_t>& kp,
                                 std::vector<uint32_t>& vp, std::vector<uint32_t>& qw) {
  // rows per register tile: RG * D / 16 zmm of sums (16 at every head_dim) beside the K/V operands
  const int D = a.d, W = D / 2, RG = D == 64 ? 4 : D == 128 ? 2 : 1;
  const int G = a.hq / a.hkv, n = a.q_lens[c], pos0 = a.ctx_lens[c] - n, seen = pos0 + i1;
  const int32_t* table = a.block_tables + a.seqs[c] * a.bt_stride;
  const int nb = (seen + 15) / 16;
  const int b0 = a.window > 0 ? std::max(0, pos0 + i0 - a.window + 1) / 16 : 0;
  kp.resize(static_cast<size_t>(nb - b0) * W * 16);
  vp.resize(static_cast<size_t>(nb - b0) * 8 * D);
  for (int b = b0; b < nb; ++b)
    pack_block(a, table, h, b, seen, kp.data() + (b - b0) * W * 16, vp.data() + (b - b0) * 8 * D);
  // the tile's query rows of this KV head's G heads, scaled and rounded to bf16: row (i - i0) * G + g
  const int rows = (i1 - i0) * G;
  qw.resize(static_cast<size_t>(rows + RG) * W);
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int i = i0; i < i1; ++i)
    for (int g = 0; g < G; ++g) {
      const float* src = a.q + (a.q_starts[c] + i) * a.q_row_stride + static_cast<int64_t>(h * G + g) * D;
      uint32_t* dst = qw.data() + static_cast<size_t>((i - i0) * G + g) * W;
      for (int j = 0; j < D; j += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + j + 16), sc),
                                               _mm512_mul_ps(_mm512_loadu_ps(src + j), sc));
        _mm512_storeu_si512(dst + j / 2, (__m512i)v);
      }
    }
  std::fill(qw.begin() + static_cast<size_t>(rows) * W, qw.end(), 0u);  // rows past the last: unused sums
  for (int r0 = 0; r0 < rows; r0 += RG) {
    if (D == 64)
      attend_rows<4, 4>(a, qw.data(), kp.data(), vp.data(), b0, r0, std::min(RG, rows - r0), G, pos0 + i0,
                        a.q_starts[c] + i0, h, a.out);
    else if (D == 256)  // Gemma 2/3's head_dim
      attend_rows<16, 1>(a, qw.data(), kp.data(), vp.data(), b0, r0, std::min(RG, rows - r0), G, pos0 + i0,
                         a.q_starts[c] + i0, h, a.out);
    else
      attend_rows<8, 2>(a, qw.data(), kp.data(), vp.data(), b0, r0, std::min(RG, rows - r0), G, pos0 + i0,
                        a.q_starts[c] + i0, h, a.out);
  }
}

struct PrefillTask {
  int64_t chunk;
  int h, i0, i1;
};

KI_BF16_TARGET void run_prefill(const PrefillArgs& a, int num_threads) {
  // One task per (chunk, KV head); with fewer than 4 per thread (one long prompt: Hkv tasks), each chunk's
  // queries are cut into tiles (at least 64) so the threads stay busy; each tile packs only the keys it sees.
  const int64_t base = a.num_chunks * a.hkv, want = 4 * static_cast<int64_t>(std::max(num_threads, 1));
  const int64_t splits = base >= want ? 1 : (want + base - 1) / base;
  std::vector<PrefillTask> tasks;
  for (int64_t c = 0; c < a.num_chunks; ++c) {
    const int n = a.q_lens[c];
    const int tile = static_cast<int>(std::max<int64_t>(64, (n + splits - 1) / splits));
    for (int h = 0; h < a.hkv; ++h)
      for (int i0 = 0; i0 < n; i0 += tile) tasks.push_back({c, h, i0, std::min(n, i0 + tile)});
  }
  // the longest (latest, seeing the most keys) first, so no thread is left with a long one at the end
  std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask& x, const PrefillTask& y) { return x.i1 > y.i1; });
  const int64_t count = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<uint32_t> kp, vp, qw;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < count; ++t)
      prefill_task(a, tasks[t].chunk, tasks[t].h, tasks[t].i0, tasks[t].i1, kp, vp, qw);
  }
}
#endif

}  // namespace

extern "C" {

// Bumped whenever a signature below changes; the loader refuses a library reporting another value.
int32_t kubeinfer_paged_decode_abi() { return 9; }

// Whether the bf16 K pass may run (set from Python's usable_cpu_features before the first call), and
// whether it does: this CPU has AVX512-BF16, this build has AVX-512, and it is allowed.
void kubeinfer_paged_decode_set_bf16(int32_t allowed) {
#if defined(__AVX512F__)
  bf16_allowed = allowed != 0;
#else
  (void)allowed;
#endif
}
// Prompt chunks over a bf16 cache in bf16 compute (see PrefillArgs): q and out fp32 [T, Hq, D] (rows
// strided), head_dim 64, 128 or 256; `window` 0 or a sliding window, `softcap` 0 or the attention logit
// soft-cap (PrefillArgs). Returns 0; -1 where this build or CPU has no such path (bf16 not enabled, or
// another head_dim) or for a negative window or soft-cap: the caller uses its own.
int32_t kubeinfer_paged_prefill(float* out, const float* q, const void* k_cache, const void* v_cache,
                                const int32_t* block_tables, const int64_t* seqs, const int64_t* q_starts,
                                const int32_t* q_lens, const int32_t* ctx_lens, int64_t num_chunks,
                                int64_t q_row_stride, int64_t out_row_stride, int64_t bt_stride, int32_t hq,
                                int32_t hkv, int32_t d, int32_t block_size, float scale, int32_t window,
                                const float* sinks, float softcap, int32_t num_threads) {
#if defined(__AVX512F__)
  if (!bf16_enabled() || (d != 64 && d != 128 && d != 256) || window < 0 || !(softcap >= 0.0f)) return -1;
  const PrefillArgs a{out,      q,      static_cast<const bf16*>(k_cache), static_cast<const bf16*>(v_cache),
                      block_tables, seqs, q_starts, q_lens, ctx_lens, num_chunks, q_row_stride, out_row_stride,
                      bt_stride, hq, hkv, d, block_size, scale, window, sinks, softcap};
  run_prefill(a, num_threads);
  return 0;
#else
  (void)out, (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)seqs, (void)q_starts, (void)q_lens;
  (void)ctx_lens, (void)num_chunks, (void)q_row_stride, (void)out_row_stride, (void)bt_stride, (void)hq, (void)hkv;
  (void)d, (void)block_size, (void)scale, (void)window, (void)sinks, (void)softcap, (void)num_threads;
  return -1;
#endif
}

// The decode passes this build runs: 2 = AVX-512 registers, 1 = AVX2 registers, 0 = the generic loops.
int32_t kubeinfer_paged_decode_isa() {
#if defined(__AVX512F__)
  return 2;
#elif defined(KI_AVX2_PATH)
  return 1;
#else
  return 0;
#endif
}

int32_t kubeinfer_paged_decode_bf16_enabled() {
#if defined(__AVX512F__)
  return bf16_enabled() ? 1 : 0;
#else
  return 0;
#endif
}

// dtype (q and out): 0 = float32, 1 = bfloat16; cache_dtype (k/v caches): 0 = float32, 1 = bfloat16,
// 2 = float16, 3 = int8 with a scale per 32 values (int8_block_elems' layout; head_dim a multiple of 32).
// Returns 0, or -1 for an unknown dtype (or an int8 cache's head_dim not a multiple of 32).
// `window` > 0: each decode query (position context_len - 1) sees only the last `window` positions.
// `sinks`: nullptr, or [hq] fp32 attention sinks (Args::sinks). `softcap`: 0, or the attention logit
// soft-cap (Args::softcap); -1 for a negative or NaN one.
int32_t kubeinfer_paged_decode_capped(int32_t dtype, int32_t cache_dtype, void* out, const void* q,
                                      const void* k_cache, const void* v_cache, const int32_t* block_tables,
                                      const int32_t* context_lens, const int64_t* seqs, const int64_t* rows,
                                      int64_t num_decode, int64_t q_row_stride, int64_t out_row_stride,
                                      int64_t bt_stride, int32_t hq, int32_t hkv, int32_t d, int32_t block_size,
                                      float scale, int32_t window, const float* sinks, float softcap,
                                      int32_t num_threads) {
  if (window < 0 || !(softcap >= 0.0f) || (cache_dtype == 3 && d % kI8Group != 0)) return -1;
  const int64_t block_elems =
      cache_dtype == 3 ? int8_block_elems(block_size, hkv, d) : static_cast<int64_t>(block_size) * hkv * d;
  const Args a{out,  q,          k_cache,      v_cache,        block_tables, context_lens,
               seqs, rows,       num_decode,   q_row_stride,   out_row_stride, bt_stride,
               hq,   hkv,        d,            block_size,     scale,          window, sinks, softcap, block_elems};
  if (dtype == 0 && cache_dtype == 0) {
    run<float, float>(a, num_threads);
  } else if (dtype == 0 && cache_dtype == 1) {
    run<float, bf16>(a, num_threads);
  } else if (dtype == 0 && cache_dtype == 2) {
    run<float, fp16>(a, num_threads);
  } else if (dtype == 1 && cache_dtype == 0) {
    run<bf16, float>(a, num_threads);
  } else if (dtype == 1 && cache_dtype == 1) {
    run<bf16, bf16>(a, num_threads);
  } else if (dtype == 1 && cache_dtype == 2) {
    run<bf16, fp16>(a, num_threads);
  } else if (dtype == 0 && cache_dtype == 3) {
    run<float, int8_t>(a, num_threads);
  } else if (dtype == 1 && cache_dtype == 3) {
    run<bf16, int8_t>(a, num_threads);
  } else {
    return -1;
  }
  return 0;
}

// kubeinfer_paged_decode_capped without a soft-cap: the decode graph's entry point for its other layers
// (server/models/csrc/cpu_fused.cpp calls it through a function pointer of this signature).
int32_t kubeinfer_paged_decode_window(int32_t dtype, int32_t cache_dtype, void* out, const void* q,
                                      const void* k_cache, const void* v_cache, const int32_t* block_tables,
                                      const int32_t* context_lens, const int64_t* seqs, const int64_t* rows,
                                      int64_t num_decode, int64_t q_row_stride, int64_t out_row_stride,
                                      int64_t bt_stride, int32_t hq, int32_t hkv, int32_t d, int32_t block_size,
                                      float scale, int32_t window, const float* sinks, int32_t num_threads) {
  return kubeinfer_paged_decode_capped(dtype, cache_dtype, out, q, k_cache, v_cache, block_tables, context_lens,
                                       seqs, rows, num_decode, q_row_stride, out_row_stride, bt_stride, hq, hkv,
                                       d, block_size, scale, window, sinks, 0.0f, num_threads);
}

// The whole context (no window): the decode graph's entry point (server/models/csrc/cpu_fused.cpp), which
// is never recorded for windowed layers.
int32_t kubeinfer_paged_decode(int32_t dtype, int32_t cache_dtype, void* out, const void* q,
                               const void* k_cache, const void* v_cache, const int32_t* block_tables,
                               const int32_t* context_lens, const int64_t* seqs, const int64_t* rows,
                               int64_t num_decode, int64_t q_row_stride, int64_t out_row_stride,
                               int64_t bt_stride, int32_t hq, int32_t hkv, int32_t d, int32_t block_size,
                               float scale, int32_t num_threads) {
  return kubeinfer_paged_decode_window(dtype, cache_dtype, out, q, k_cache, v_cache, block_tables, context_lens,
                                       seqs, rows, num_decode, q_row_stride, out_row_stride, bt_stride, hq, hkv,
                                       d, block_size, scale, 0, nullptr, num_threads);
}

// The decode graph's K/V write (server/models/csrc/cpu_fused.cpp): for each row r < t, the fp32 rows
// k + r * src_stride and v + r * src_stride (Hkv * D elements each, heads contiguous) go to slot slots[r]
// of the caches ([num_blocks, block_size, Hkv, D], codes as above): rounded to a float cache's dtype to
// nearest even, as torch's .to() and the Python path's index_copy_ do; into an int8 cache each group x of
// 32 values of a head's row as round(x * (127 / max|x|)) (ties to even), its scale max|x| * (1 / 127)
// (int8_block_elems' layout; a group of zeros has scale 0). Returns 0, or -1 for an unknown dtype.
int32_t kubeinfer_kv_store(int32_t cache_dtype, void* k_cache, void* v_cache, const int64_t* slots,
                           const float* k, const float* v, int64_t src_stride, int64_t t, int32_t hkv, int32_t d,
                           int32_t block_size) {
  if (cache_dtype < 0 || cache_dtype > 3 || hkv < 1 || d < 1 || block_size < 1) return -1;
  if (cache_dtype == 3 && d % kI8Group != 0) return -1;
  const int64_t width = static_cast<int64_t>(hkv) * d;
  for (int64_t r = 0; r < t; ++r) {
    const float* kr = k + r * src_stride;
    const float* vr = v + r * src_stride;
    const int64_t base = slots[r] * width;
    if (cache_dtype == 0) {
      std::memcpy(static_cast<float*>(k_cache) + base, kr, width * sizeof(float));
      std::memcpy(static_cast<float*>(v_cache) + base, vr, width * sizeof(float));
    } else if (cache_dtype == 1) {
      bf16* kd = static_cast<bf16*>(k_cache) + base;
      bf16* vd = static_cast<bf16*>(v_cache) + base;
      for (int64_t j = 0; j < width; ++j) from_float(kr[j], kd + j);
      for (int64_t j = 0; j < width; ++j) from_float(vr[j], vd + j);
    } else if (cache_dtype == 2) {
      fp16* kd = static_cast<fp16*>(k_cache) + base;
      fp16* vd = static_cast<fp16*>(v_cache) + base;
      for (int64_t j = 0; j < width; ++j) from_float(kr[j], kd + j);
      for (int64_t j = 0; j < width; ++j) from_float(vr[j], vd + j);
    } else {
      const int64_t block_elems = int8_block_elems(block_size, hkv, d);
      const int64_t b = slots[r] / block_size;
      const int off = static_cast<int>(slots[r] % block_size);
      for (int which = 0; which < 2; ++which) {
        int8_t* block = static_cast<int8_t*>(which ? v_cache : k_cache) + b * block_elems;
        const float* src = which ? vr : kr;
        for (int h = 0; h < hkv; ++h) {
          float* sc = const_cast<float*>(row_scales(static_cast<const int8_t*>(block), off, h, block_size, hkv, d));
          int8_t* dst = block + (static_cast<int64_t>(off) * hkv + h) * d;
          const float* x = src + static_cast<int64_t>(h) * d;
          for (int g = 0; g < d / kI8Group; ++g) {
            const float* xg = x + g * kI8Group;
            float amax = 0.0f;
            for (int j = 0; j < kI8Group; ++j) amax = std::max(amax, std::fabs(xg[j]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int j = 0; j < kI8Group; ++j)
              dst[g * kI8Group + j] =
                  static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(xg[j] * inv))));
            sc[g] = amax * (1.0f / 127.0f);  // -ffast-math makes a division by 127 this product anyway
          }
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
