// Paged decode attention for CPU: one query token per sequence, each K/V row of the paged cache read once.
//
// Built at run time by server/attention/cpu_kernel.py and called through ctypes, so it has a plain C ABI
// and includes no torch headers. Layouts:
//   q, out        [T, Hq, D]            rows[i] is the row of decode sequence i; rows may be strided
//                                       (q is often a view into the fused qkv projection)
//   k/v cache     [num_blocks, block_size, Hkv, D]      contiguous
//   block_tables  [num_seqs, bt_stride] int32, seqs[i] is the row of decode sequence i
//   context_lens  [num_seqs] int32
// One task per sequence: its blocks stream from memory once, each K/V row serving the G = Hq / Hkv
// query heads that share it.
// OpenMP comes from the libgomp torch has already loaded (same soname), so it shares torch's threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void from_float(float x, float* dst) { *dst = x; }
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
};

template <typename T>
void attend_seq(const Args& a, int64_t i, std::vector<float>& scores, std::vector<float>& acc,
                std::vector<float>& qf) {
  const int HQ = a.hq, HKV = a.hkv, G = HQ / HKV, D = a.d, BS = a.block_size;
  const int64_t seq = a.seqs[i], row = a.rows[i];
  const int ctx = a.context_lens[seq];
  const int32_t* table = a.block_tables + seq * a.bt_stride;
  const int64_t block_elems = static_cast<int64_t>(BS) * HKV * D;  // one block is contiguous
  const T* q = static_cast<const T*>(a.q) + row * a.q_row_stride;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  // scores[hq][t]: every query head's score of every context position
  scores.resize(static_cast<size_t>(HQ) * ctx);
  acc.assign(static_cast<size_t>(HQ) * D, 0.0f);
  qf.resize(static_cast<size_t>(HQ) * D);
  for (int j = 0; j < HQ * D; ++j) qf[j] = to_float(q[j]) * a.scale;

  // Blocks are walked in order and each is read front to back: the whole sequence streams from memory.
  for (int t0 = 0; t0 < ctx; t0 += BS) {
    const int n = std::min(BS, ctx - t0);
    const T* kb = kc + table[t0 / BS] * block_elems;
    for (int u = 0; u < n; ++u) {
      for (int h = 0; h < HKV; ++h) {
        const T* kr = kb + (static_cast<int64_t>(u) * HKV + h) * D;
        for (int g = 0; g < G; ++g) {
          const float* qh = qf.data() + (h * G + g) * D;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int j = 0; j < D; ++j) s += qh[j] * to_float(kr[j]);
          scores[static_cast<size_t>(h * G + g) * ctx + t0 + u] = s;
        }
      }
    }
  }

  std::vector<float> inv_sum(HQ);
  for (int hh = 0; hh < HQ; ++hh) {
    float* s = scores.data() + static_cast<size_t>(hh) * ctx;
    float m = s[0];
    for (int t = 1; t < ctx; ++t) m = std::max(m, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < ctx; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inv_sum[hh] = 1.0f / sum;
  }

  for (int t0 = 0; t0 < ctx; t0 += BS) {
    const int n = std::min(BS, ctx - t0);
    const T* vb = vc + table[t0 / BS] * block_elems;
    for (int u = 0; u < n; ++u) {
      for (int h = 0; h < HKV; ++h) {
        const T* vr = vb + (static_cast<int64_t>(u) * HKV + h) * D;
        for (int g = 0; g < G; ++g) {
          const float p = scores[static_cast<size_t>(h * G + g) * ctx + t0 + u];
          float* ah = acc.data() + (h * G + g) * D;
#pragma omp simd
          for (int j = 0; j < D; ++j) ah[j] += p * to_float(vr[j]);
        }
      }
    }
  }

  T* o = static_cast<T*>(a.out) + row * a.out_row_stride;
  for (int hh = 0; hh < HQ; ++hh)
    for (int j = 0; j < D; ++j) from_float(acc[hh * D + j] * inv_sum[hh], o + hh * D + j);
}

template <typename T>
void run(const Args& a, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc, qf;  // per thread, reused across its sequences
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a.num_decode; ++i) attend_seq<T>(a, i, scores, acc, qf);
  }
}

}  // namespace

extern "C" {

// Bumped whenever the signature below changes; the loader refuses a library reporting another value.
int32_t kubeinfer_paged_decode_abi() { return 1; }

// dtype: 0 = float32, 1 = bfloat16 (for q, caches and out alike). Returns 0, or -1 for an unknown dtype.
int32_t kubeinfer_paged_decode(int32_t dtype, void* out, const void* q, const void* k_cache,
                               const void* v_cache, const int32_t* block_tables,
                               const int32_t* context_lens, const int64_t* seqs, const int64_t* rows,
                               int64_t num_decode, int64_t q_row_stride, int64_t out_row_stride,
                               int64_t bt_stride, int32_t hq, int32_t hkv, int32_t d, int32_t block_size,
                               float scale, int32_t num_threads) {
  const Args a{out,  q,          k_cache,      v_cache,        block_tables, context_lens,
               seqs, rows,       num_decode,   q_row_stride,   out_row_stride, bt_stride,
               hq,   hkv,        d,            block_size,     scale};
  if (dtype == 0) {
    run<float>(a, num_threads);
  } else if (dtype == 1) {
    run<bf16>(a, num_threads);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
