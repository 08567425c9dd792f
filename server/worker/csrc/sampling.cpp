// Sampled rows' tokens on CPU: temperature, top-k, top-p, min-p, then one draw by inverse CDF, a few passes
// over each row instead of the ~10 torch ops (a 128k-value sort for top-p) a row cost one at a time.
//
// Built at run time by server/worker/cpu_sampling.py (through server/native.py), called via ctypes: a plain C
// ABI, no torch headers. The semantics are server/worker/sampler.py's torch path, which the tests compare
// against: s = logits / temperature; top-k keeps s >= the k-th largest s (ties of it included); top-p sorts
// what is left by probability and keeps a token while the mass before it is < top_p (the first always
// stays); min-p keeps probabilities >= min_p x the largest; the token is the first index whose cumulative
// kept mass exceeds u x the kept mass (u uniform in [0, 1): one draw a row, the caller's, so a seeded
// request's u comes from its own generator). Ties at top-p's cut keep the lowest indices (torch's sort
// leaves their order unspecified).
//
// Probabilities are e = exp(s - max s) in fp32 (a polynomial the compiler vectorizes: within 2 ulp of expf,
// exactly 1 at the max and 0 below e^-87), their sums in double. Built without -ffast-math: masked logits
// are -inf and the compares must see them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kParallelMin = 1 << 15;  // values below which one thread takes every row
constexpr int64_t kBlock = 256;            // values per partial sum of the draw's first pass
constexpr int kKeyBins = 2048;             // top-k's histogram: the top 11 bits of an order key
constexpr int kMassBins = 1024;            // top-p's histogram: the top 10 bits of e in (0, 1]

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Unsigned keys ordered as the floats are (NaNs excluded by the caller).
inline uint32_t order_key(float f) {
  const uint32_t b = float_bits(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// e^x for x <= 0 (Cephes' expf: n = round(x / ln 2), e^r on r in [-ln2/2, ln2/2] by a degree-5 polynomial,
// 2^n through the exponent bits); 0 below -87 (and for -inf), where 2^n would leave the normal range.
inline float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

struct Row {
  const float* logits;  // [n]
  int64_t n;
  float temperature;  // > 0
  int32_t top_k;      // 0: off
  float top_p;        // 1: off
  float min_p;        // 0: off
  double u;           // [0, 1)
};

// The k-th largest of s[0..n) (1 <= k <= n): an 11-bit histogram of order keys finds the bin that holds it,
// a partial sort of that bin's values the value itself.
float kth_largest(const float* s, int64_t n, int64_t k, std::vector<float>& cand) {
  uint32_t split[4][kKeyBins] = {};  // four histograms in turn, as in top-p's
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) ++split[j][order_key(s[i + j]) >> 21];
  for (; i < n; ++i) ++split[0][order_key(s[i]) >> 21];
  uint32_t hist[kKeyBins];
  for (int b = 0; b < kKeyBins; ++b) hist[b] = split[0][b] + split[1][b] + split[2][b] + split[3][b];
  int64_t above = 0;
  int bin = kKeyBins - 1;
  for (; bin > 0; --bin) {
    if (above + static_cast<int64_t>(hist[bin]) >= k) break;
    above += hist[bin];
  }
  cand.clear();
  for (i = 0; i < n; ++i)
    if (static_cast<int>(order_key(s[i]) >> 21) == bin) cand.push_back(s[i]);
  const int64_t rank = k - above - 1;  // 0-based within the bin, largest first
  std::nth_element(cand.begin(), cand.begin() + rank, cand.end(), std::greater<float>());
  return cand[rank];
}

// Top-p's cut: every token whose logit is above `logit` stays, and of those whose logit equals it the first
// `ties_kept` in index order (`ties_total` of them in all).
struct Cut {
  float logit;
  int64_t ties_kept, ties_total;
};

using Pool = std::vector<std::pair<float, int64_t>>;  // (e, index) pairs, gathered in index order

// A pool too large to sort (a flat distribution puts most of a row in one bin of the top bits: 100k values of
// a 128k row, 10 ms a row to sort) narrowed to the sub-bin of e's bits [shift, shift + 10) where the cut falls,
// shift from `shift0` down by 10; the mass of the sub-bins above joins `mass_above`. The pool's values share
// the bits above shift0 + 10 (e <= 1: bit 30 is 0).
constexpr size_t kSortMax = 2048;

void narrow_pool(Pool& pool, double* mass_above, double target, int shift0) {
  for (int shift = shift0; shift >= 0 && pool.size() > kSortMax; shift -= 10) {
    const float first = pool[0].first;
    if (std::all_of(pool.begin(), pool.end(), [first](const auto& e) { return e.first == first; })) return;
    double split[4][1024] = {};  // four histograms in turn, as in top-p's first level
    const size_t size = pool.size();
    for (size_t i = 0; i < size; ++i) {
      const float v = pool[i].first;
      split[i & 3][(float_bits(v) >> shift) & 0x3ffu] += v;
    }
    double mass[1024];
    int lowest = 1023;  // the lowest sub-bin holding a value (every value in the pool is > 0)
    for (int b = 1023; b >= 0; --b) {
      mass[b] = split[0][b] + split[1][b] + split[2][b] + split[3][b];
      if (mass[b] > 0.0) lowest = b;
    }
    // Down to the lowest sub-bin at most: these sums, in another order than the ones that chose the pool,
    // may fall short of the target by a rounding; the pool's last values are then the ones it needs.
    int bin = 1023;
    for (; bin > lowest; --bin) {
      if (*mass_above + mass[bin] >= target) break;
      *mass_above += mass[bin];
    }
    size_t kept = 0;
    for (const auto& entry : pool)
      if (static_cast<int>((float_bits(entry.first) >> shift) & 0x3ffu) == bin) pool[kept++] = entry;
    pool.resize(kept);
  }
}

// The cut within `pool` (the tokens that may hold it; `mass_above`: the mass of every e above them), in the
// torch path's order: probability, then logit (equal fp32 probabilities can hide a logit order), largest
// first, then index ascending (torch's sort leaves equal logits' order unspecified).
Cut cut_from_pool(Pool& pool, const float* x, double mass_above, double target) {
  const float e0 = pool.empty() ? 0.0f : pool[0].first, x0 = pool.empty() ? 0.0f : x[pool[0].second];
  // A pool narrowed past kSortMax holds one value (a padded vocabulary's zero logits: 79,104 of a
  // 128,256-token row of our Llama-shaped test model): already in the order wanted.
  const bool one_value =
      std::all_of(pool.begin(), pool.end(), [&](const auto& e) { return e.first == e0 && x[e.second] == x0; });
  if (!one_value)
    std::sort(pool.begin(), pool.end(), [x](const auto& a, const auto& b) {
      if (a.first != b.first) return a.first > b.first;
      if (x[a.second] != x[b.second]) return x[a.second] > x[b.second];
      return a.second < b.second;
    });
  Cut cut{-std::numeric_limits<float>::infinity(), 0, 0};
  double prefix = mass_above;
  for (const auto& [v, idx] : pool) {
    if (prefix >= target) break;
    if (cut.ties_kept == 0 || x[idx] != cut.logit) {
      cut.logit = x[idx];
      cut.ties_kept = 0;
    }
    ++cut.ties_kept;
    prefix += v;
  }
  for (const auto& entry : pool) cut.ties_total += x[entry.second] == cut.logit ? 1 : 0;
  return cut;
}

// Top-p's cut over e[0..n) (a row's unnormalized probabilities; x: its logits), `target` = top_p x their sum.
// `few`: top-k left few nonzero values (gathered whole).
Cut top_p_cut(const float* e, const float* x, int64_t n, bool few, double target, Pool& pool) {
  pool.clear();
  double mass_above = 0.0;
  if (few) {
    for (int64_t i = 0; i < n; ++i)
      if (e[i] > 0.0f) pool.emplace_back(e[i], i);
    narrow_pool(pool, &mass_above, target, 20);
    return cut_from_pool(pool, x, mass_above, target);
  }
  // the mass in bins of e's top bits, largest first, finds the bin where the cut falls; four histograms,
  // values taken in turn: a run of values in one bin would wait on each add otherwise
  double split[4][kMassBins] = {};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) split[j][float_bits(e[i + j]) >> 20] += e[i + j];
  for (; i < n; ++i) split[0][float_bits(e[i]) >> 20] += e[i];
  double mass[kMassBins];
  for (int b = 0; b < kMassBins; ++b) mass[b] = split[0][b] + split[1][b] + split[2][b] + split[3][b];
  uint32_t bin = kMassBins - 1;
  for (; bin > 0; --bin) {
    if (mass_above + mass[bin] >= target) break;
    mass_above += mass[bin];
  }
  // One logit in the bin (a padded vocabulary's equal logits: 79,104 zeros in a 128,256-token row of our
  // Llama-shaped test model) needs no gathering: how many of its ties reach the target is arithmetic.
  float first = 0.0f, first_x = 0.0f;
  for (i = 0; i < n && first == 0.0f; ++i)
    if (e[i] > 0.0f && (float_bits(e[i]) >> 20) == bin) first = e[i], first_x = x[i];
  int64_t count = 0;
  int32_t differ = 0;
#pragma omp simd reduction(+ : count) reduction(| : differ)
  for (int64_t j = 0; j < n; ++j) {
    const int32_t in = e[j] > 0.0f && (float_bits(e[j]) >> 20) == bin ? 1 : 0;
    count += in;
    differ |= in & (x[j] != first_x ? 1 : 0);
  }
  if (count > 0 && !differ) {  // keep the j-th tie while mass_above + (j - 1) x first < target
    const double need = std::ceil((target - mass_above) / first);
    return Cut{first_x, std::min<int64_t>(count, std::max<int64_t>(1, static_cast<int64_t>(need))), count};
  }
  for (i = 0; i < n; ++i)
    if (e[i] > 0.0f && (float_bits(e[i]) >> 20) == bin) pool.emplace_back(e[i], i);
  narrow_pool(pool, &mass_above, target, 10);
  return cut_from_pool(pool, x, mass_above, target);
}

// A thread's buffers, kept across rows and calls.
struct Scratch {
  std::vector<float> e, cand;
  Pool pool;
  std::vector<double> sums;
};

// The token, or -1 where the row has no candidate (every logit -inf or NaN). probs (optional): the distribution
// drawn from, normalized. NaN logits are no candidates; +inf ones, where there are any, share the mass evenly
// (softmax's limit), as in the torch path.
int64_t sample_row(const Row& row, float* probs, Scratch& scratch) {
  auto& [e, cand, pool, sums] = scratch;
  const int64_t n = row.n;
  e.resize(n);
  float* s = e.data();
  const float* __restrict x = row.logits;  // a local: GCC gathered through row.logits otherwise
  const float t = row.temperature;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float m = -kInf;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] / t;
    s[i] = v != v ? -kInf : v;  // a NaN (penalties' inf - inf) is no candidate
    m = s[i] > m ? s[i] : m;
  }
  if (m == -kInf) return -1;
  if (m == kInf) {  // softmax's limit as those logits grow: uniform over the +inf ones (extreme penalties)
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] = s[i] == kInf ? 0.0f : -kInf;
    m = 0.0f;
  }
  const bool top_k = row.top_k > 0 && row.top_k < n;
  const float kth = top_k ? kth_largest(s, n, row.top_k, cand) : -kInf;
  double z = 0.0;
#pragma omp simd reduction(+ : z)
  for (int64_t i = 0; i < n; ++i) {
    const float si = s[i];
    const float ex = exp_nonpositive(si - m);
    const float v = si >= kth ? ex : 0.0f;
    s[i] = v;
    z += v;
  }
  float* p = s;  // from here on e, in place of s
  if (row.top_p < 1.0f) {
    const Cut cut = top_p_cut(p, x, n, top_k, static_cast<double>(row.top_p) * z, pool);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) p[i] = x[i] >= cut.logit ? p[i] : 0.0f;
    if (cut.ties_total > cut.ties_kept) {  // the cut's ties past the kept ones, in index order
      int64_t i = 0, seen = 0;
      for (; i < n && seen < cut.ties_kept; ++i) seen += x[i] == cut.logit ? 1 : 0;  // no branch on where ties fall
#pragma omp simd
      for (int64_t j = i; j < n; ++j) p[j] = x[j] == cut.logit ? 0.0f : p[j];
    }
  }
  if (row.min_p > 0.0f) {  // against the largest kept probability: e = 1 at the max, which every filter keeps
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] >= row.min_p ? p[i] : 0.0f;
  }
  // The draw: block sums, the block where u x total falls, then value by value within it.
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i1 = std::min(n, (b + 1) * kBlock);
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b * kBlock; i < i1; ++i) acc += p[i];
    sums[b] = acc;
    total += acc;
  }
  if (probs) {
    const float inv = static_cast<float>(1.0 / total);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) probs[i] = p[i] * inv;
  }
  const double target = row.u * total;
  double acc = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (acc + sums[b] <= target) {
      acc += sums[b];
      continue;
    }
    const int64_t i0 = b * kBlock, i1 = std::min(n, (b + 1) * kBlock);
    int64_t last = -1;
    for (int64_t i = i0; i < i1; ++i) {
      acc += p[i];
      if (p[i] > 0.0f) {
        if (acc > target) return i;
        last = i;
      }
    }
    return last;  // rounding left the block's values short of the target: its last kept one
  }
  for (int64_t i = n - 1; i >= 0; --i)  // u x total rounded up to the total
    if (p[i] > 0.0f) return i;
  return -1;  // unreachable: the max always stays
}

}  // namespace

extern "C" {

int32_t kubeinfer_sampling_abi() { return 1; }

// logits: rows of `vocab` fp32 values `stride` apart; row r of the batch is logits row row_ids[r] (or r where
// row_ids is null). Per row: temperature (> 0), top_k (0 off), top_p ((0, 1], 1 off), min_p ([0, 1], 0 off),
// u ([0, 1)). out[r]: the token, or -1 where the row has no candidate (every logit -inf or NaN). probs (optional):
// [rows, vocab] with row stride probs_stride, each row the normalized distribution its token was drawn from.
// Returns 0, or 1 on a bad argument (nothing written).
int32_t kubeinfer_sample_rows(const float* logits, int64_t stride, const int64_t* row_ids, int64_t rows,
                              int64_t vocab, const float* temperature, const int32_t* top_k, const float* top_p,
                              const float* min_p, const double* u, int64_t* out, float* probs,
                              int64_t probs_stride, int32_t threads) {
  if (!logits || !temperature || !top_k || !top_p || !min_p || !u || !out) return 1;
  if (rows < 0 || vocab <= 0 || stride < vocab || (probs && probs_stride < vocab)) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    const bool ok = temperature[r] > 0.0f && std::isfinite(temperature[r]) && top_k[r] >= 0 && top_p[r] > 0.0f &&
                    top_p[r] <= 1.0f && min_p[r] >= 0.0f && min_p[r] <= 1.0f && u[r] >= 0.0 && u[r] < 1.0 &&
                    (!row_ids || row_ids[r] >= 0);
    if (!ok) return 1;
  }
#pragma omp parallel num_threads(threads) if (rows > 1 && rows * vocab >= kParallelMin)
  {
    // Kept by the thread across calls (OpenMP's threads persist): a fresh 512 KB buffer a call cost more in
    // page faults than the row's arithmetic.
    thread_local Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t src = row_ids ? row_ids[r] : r;
      const Row row{logits + src * stride, vocab, temperature[r], top_k[r], top_p[r], min_p[r], u[r]};
      out[r] = sample_row(row, probs ? probs + r * probs_stride : nullptr, scratch);
    }
  }
  return 0;
}

}  // extern "C"
