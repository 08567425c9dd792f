// Paged decode attention for CPU: one query token per sequence, each K/V row of the paged cache read once.
//
// Built at run time by server/attention/cpu_kernel.py and called through ctypes, so it has a plain C ABI
// and includes no torch headers. Layouts:
//   q, out        [T, Hq, D]            rows[i] is the row of decode sequence i; rows may be strided
//                                       (q is often a view into the fused qkv projection)
//   k/v cache     [num_blocks, block_size, Hkv, D]      contiguous
//   block_tables  [num_seqs, bt_stride] int32, seqs[i] is the row of decode sequence i
//   context_lens  [num_seqs] int32
// One task per part of a sequence's context (the whole context unless there are too few sequences to
// keep the threads busy): its blocks stream from memory once, each K/V row serving the G = Hq / Hkv
// query heads that share it. A second pass merges each sequence's parts (log-sum-exp rescaling).
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

// One slice of one sequence's context: tokens [t_begin, t_end), whole blocks except at the end.
struct Part {
  int64_t i;  // decode sequence
  int t_begin, t_end;
};

// Calls f(t, h, row) for every K or V row of the part: t its position in the part, h its KV head.
// Blocks are walked in order and each is read front to back, so the part streams from memory.
template <typename T, typename F>
inline void for_each_row(const Args& a, const Part& part, const int32_t* table, const T* cache, F&& f) {
  const int HKV = a.hkv, D = a.d, BS = a.block_size;
  const int64_t block_elems = static_cast<int64_t>(BS) * HKV * D;  // one block is contiguous
  for (int t = part.t_begin; t < part.t_end;) {
    const int off = t % BS, n = std::min(BS - off, part.t_end - t);
    const T* block = cache + table[t / BS] * block_elems;
    for (int u = 0; u < n; ++u)
      for (int h = 0; h < HKV; ++h)
        f(t - part.t_begin + u, h, block + (static_cast<int64_t>(off + u) * HKV + h) * D);
    t += n;
  }
}

// Attends one part for every query head; leaves in m/l/acc (each [Hq] or [Hq, D]) the part's score max,
// its sum of exp(score - max) and the matching unnormalized sum of V rows.
template <typename T>
void attend_part(const Args& a, const Part& part, std::vector<float>& scores, std::vector<float>& qf,
                 float* m_out, float* l_out, float* acc) {
  const int HQ = a.hq, G = HQ / a.hkv, D = a.d;
  const int64_t seq = a.seqs[part.i], row = a.rows[part.i];
  const int n_tok = part.t_end - part.t_begin;
  const int32_t* table = a.block_tables + seq * a.bt_stride;
  const T* q = static_cast<const T*>(a.q) + row * a.q_row_stride;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  // scores[hq][t - t_begin]: every query head's score of every position in the part
  scores.resize(static_cast<size_t>(HQ) * n_tok);
  qf.resize(static_cast<size_t>(HQ) * D);
  for (int j = 0; j < HQ * D; ++j) qf[j] = to_float(q[j]) * a.scale;
  std::fill(acc, acc + static_cast<size_t>(HQ) * D, 0.0f);

  for_each_row(a, part, table, kc, [&](int t, int h, const T* kr) {
    for (int g = 0; g < G; ++g) {
      const float* qh = qf.data() + (h * G + g) * D;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int j = 0; j < D; ++j) s += qh[j] * to_float(kr[j]);
      scores[static_cast<size_t>(h * G + g) * n_tok + t] = s;
    }
  });

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

  for_each_row(a, part, table, vc, [&](int t, int h, const T* vr) {
    for (int g = 0; g < G; ++g) {
      const float p = scores[static_cast<size_t>(h * G + g) * n_tok + t];
      float* ah = acc + (h * G + g) * D;
#pragma omp simd
      for (int j = 0; j < D; ++j) ah[j] += p * to_float(vr[j]);
    }
  });
}

// Tokens per part: whole sequences while there are enough of them to keep every thread busy; with few
// sequences (one user, long context) their contexts are cut into slices of whole blocks, at least
// kMinPartTokens long so that the combine pass stays negligible.
constexpr int kMinPartTokens = 256;

std::vector<Part> make_parts(const Args& a, int num_threads) {
  int64_t total_blocks = 0;
  for (int64_t i = 0; i < a.num_decode; ++i)
    total_blocks += (a.context_lens[a.seqs[i]] + a.block_size - 1) / a.block_size;
  const int64_t target_tasks = 4 * static_cast<int64_t>(std::max(num_threads, 1));
  const int64_t min_blocks = std::max<int64_t>(1, kMinPartTokens / a.block_size);
  const int64_t part_blocks = std::max(min_blocks, (total_blocks + target_tasks - 1) / target_tasks);
  const int64_t part_tokens = part_blocks * a.block_size;
  std::vector<Part> parts;
  for (int64_t i = 0; i < a.num_decode; ++i) {
    const int ctx = a.context_lens[a.seqs[i]];
    for (int64_t t = 0; t < ctx; t += part_tokens)
      parts.push_back({i, static_cast<int>(t), static_cast<int>(std::min<int64_t>(ctx, t + part_tokens))});
  }
  return parts;
}

template <typename T>
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
      attend_part<T>(a, parts[p], scores, qf, &m[p * HQ], &l[p * HQ], &acc[p * HQ * D]);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < a.num_decode; ++i) {
      T* o = static_cast<T*>(a.out) + a.rows[i] * a.out_row_stride;
      const int64_t p0 = first_part[i], p1 = first_part[i + 1];
      for (int hh = 0; hh < HQ; ++hh) {
        float m_max = m[p0 * HQ + hh];
        for (int64_t p = p0 + 1; p < p1; ++p) m_max = std::max(m_max, m[p * HQ + hh]);
        float denom = 0.0f;
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
