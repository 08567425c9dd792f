// y = x W^T (+ bias) for bf16 x and W at the few rows of a decode step, with AVX512-BF16 `vdpbf16ps`.
//
// Why not oneDNN: at 1-64 rows its packed bf16 GEMM streamed weights at ~10 GB/s on Zen 4, about half of
// what the int8 kernels reach; decode at few rows is bound by the weight stream, so the kernel below reads
// each weight vector once per tile of up to TILE_M rows of x and keeps the block of panels a thread owns
// in L2 while further row tiles pass over it (at 9-64 rows chunk by chunk of K: run_chunked).
//
// Weight layout (kubeinfer_bf16_pack): W [N, K] -> panels of 16 output columns; panel p holds, for each
// pair of input values (2kk, 2kk+1), the 16 columns' pairs side by side: packed[p][kk][j][t] =
// W[16p + j][2kk + t], zero past N and K. One 512-bit load is then the operand `vdpbf16ps` wants, and one
// broadcast 32-bit pair of x feeds 16 columns. K is padded to even (the launcher pads x likewise).
// Accumulation is fp32 in K order (vdpbf16ps adds each pair's two products to the accumulator; it flushes
// denormal inputs and outputs and rounds to nearest even, whatever MXCSR says: Intel SDM, VDPBF16PS).
// Output: fp32, or bf16 rounded to nearest even (the rounding F.linear's bf16 output has).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int PANEL = 16;      // output columns per panel: one zmm of fp32 accumulators
constexpr int TILE_M = 8;      // rows of x per pass over a block
constexpr int BLOCK_PANELS = 3; // panels a micro-kernel keeps in registers: 8 x 3 accumulators + 3 weights

// Each panel's bytes PF_AHEAD_PAIRS x 64 B (4 KB) further on are fetched into L1 as a pass reads it: the
// NP panels are NP streams 32 K bytes apart per thread, and the hardware prefetcher alone streamed them at
// 46-50 GB/s (a [16384, 2048] weight not in cache, 2-core Zen 5 whose two threads read 77 GB/s): with it
// up to 73-76 GB/s at 1-8 rows; 16 rows 1.74-2.09 -> 1.60-1.63 ms over three alternated builds (64 pairs
// ahead: 16 and 128 were slower).
constexpr int64_t PF_AHEAD_PAIRS = 64;
// run_chunked, for 9-64 rows: a block's K in chunks of 512 pairs (3 panels: 96 KB, two of them within a
// Zen 5's 1 MB L2). Cold [N, K] weights at 16 rows, 2 threads (benchmarks/bf16_gemm.py --cold): 256, 512 and
// 1024 within noise of each other, 10-13% under one whole-K pass per tile.
constexpr int64_t CHUNK_PAIRS = 512;
constexpr int CHUNKED_TILES = 8;
// run_whole takes rows in groups of at most this many bytes of x: every block's passes read the group's x
// again, and where x outgrows the last-level cache each block reads it from memory. [2048, 8192] rows into
// Llama-3.2-1B's down projection (32 MB of x): 88.8-96.8 -> 78-83 ms with 4-8 MB groups, 1-2 MB slower; the
// same where x fits (K = 2048). Groups as even as whole tiles allow (a short last group reads its blocks for
// few rows).
constexpr int64_t X_GROUP_BYTES = 8 << 20;
int g_path = 0;  // 1: avx512bf16, 0: scalar; the launcher picks 1 where usable_cpu_features() has AVX512-BF16

// Panels in the block that starts at panel p0 (the last block may be short).
inline int block_panels(int64_t panels, int64_t p0) {
  return static_cast<int>(std::min<int64_t>(panels - p0, BLOCK_PANELS));
}

// The end of the K chunk (in pairs) that starts at kk.
inline int64_t chunk_end(int64_t kk, int64_t k2) { return std::min(kk + CHUNK_PAIRS, k2); }

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Problem {
  const uint16_t* wp;  // packed panels
  int64_t n, k2;       // output columns, pairs of input values (padded K / 2)
  const uint16_t* x;   // [m, 2 k2] bf16, row stride ldx
  int64_t m, ldx;
  const float* bias;   // [n] fp32 or null
  uint16_t* out_bf16;  // [m, n] row stride ldo, or null
  float* out_f32;      // [m, n] row stride ldo, or null
  int64_t ldo;
  bool round_f32;      // out_f32 holds each sum rounded to bf16 (a bf16 model's logits, widened in place)
};

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void store_tile(const Problem& pr, int64_t row, int64_t col, __m512 acc) {
  const int64_t left = pr.n - col;
  const __mmask16 mask = left >= PANEL ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
  if (pr.bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, pr.bias + col));
  if (pr.out_f32 && !pr.round_f32) {
    _mm512_mask_storeu_ps(pr.out_f32 + row * pr.ldo + col, mask, acc);
    return;
  }
  __m256bh h = _mm512_cvtneps_pbh(acc);
  __m256i hi;
  std::memcpy(&hi, &h, sizeof(hi));
  if (pr.out_f32) {  // the bf16 value widened exactly: its bits in the upper half of an fp32
    const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    _mm512_mask_storeu_ps(pr.out_f32 + row * pr.ldo + col, mask, wide);
  } else {
    _mm256_mask_storeu_epi16(pr.out_bf16 + row * pr.ldo + col, mask, hi);
  }
}

// Where a pass fetches the next chunk of its block (run_chunked): `lines[j]` is panel j's next chunk, `pairs`
// 64-byte lines each; this pass fetches every `period`-th pair row of them starting at `phase`, so the
// passes over one chunk share the fetching of the next.
struct NextChunk {
  const char* lines[3];
  int np;
  int64_t pairs;
  int phase, period;
};

// acc over pairs [kk0, kk1) for rows row0.. and panels panel0..: starts from `partial` (kk0 > 0) or zero,
// ends in `partial` (kk1 < k2) or the output. `partial`: [MR][NP][16] fp32, this pass's own.
template <int MR, int NP>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void micro(const Problem& pr, int64_t row0, int64_t panel0, int64_t kk0, int64_t kk1, float* partial,
           const NextChunk* next) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j)
      acc[r][j] = kk0 > 0 ? _mm512_loadu_ps(partial + (r * NP + j) * PANEL) : _mm512_setzero_ps();
  const int64_t panel_elems = pr.k2 * 2 * PANEL;
  const uint16_t* w0 = pr.wp + panel0 * panel_elems;
  const uint16_t* xr = pr.x + row0 * pr.ldx;
  int64_t next_row = next ? next->phase : 0;
  int countdown = 1;
  for (int64_t kk = kk0; kk < kk1; ++kk) {
    __m512bh w[NP];
    for (int j = 0; j < NP; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w0 + j * panel_elems + (kk + PF_AHEAD_PAIRS) * 2 * PANEL), _MM_HINT_T0);
    if (next && --countdown == 0) {
      countdown = next->period;
      if (next_row < next->pairs) {
        for (int j = 0; j < next->np; ++j) _mm_prefetch(next->lines[j] + next_row * 64, _MM_HINT_T1);
        next_row += next->period;
      }
    }
    for (int j = 0; j < NP; ++j) {
      __m512i v = _mm512_loadu_si512(w0 + j * panel_elems + kk * 2 * PANEL);
      std::memcpy(&w[j], &v, sizeof(v));
    }
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr + r * pr.ldx + 2 * kk, 4);
      __m512i b = _mm512_set1_epi32(pair);
      __m512bh bb;
      std::memcpy(&bb, &b, sizeof(b));
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], bb, w[j]);
    }
  }
  if (kk1 < pr.k2) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) _mm512_storeu_ps(partial + (r * NP + j) * PANEL, acc[r][j]);
    return;
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) store_tile(pr, row0 + r, (panel0 + j) * PANEL, acc[r][j]);
}

using Micro = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, float*, const NextChunk*);

template <int NP>
constexpr Micro pick_rows(int mr) {
  switch (mr) {
    case 1: return micro<1, NP>;
    case 2: return micro<2, NP>;
    case 3: return micro<3, NP>;
    case 4: return micro<4, NP>;
    case 5: return micro<5, NP>;
    case 6: return micro<6, NP>;
    case 7: return micro<7, NP>;
    default: return micro<8, NP>;
  }
}

Micro pick(int mr, int np) {
  switch (np) {
    case 1: return pick_rows<1>(mr);
    case 2: return pick_rows<2>(mr);
    default: return pick_rows<3>(mr);
  }
}

// One pass of each row tile over a block's whole K: at 1-8 rows (one tile), and at many rows, where each
// block is read from memory once per group of rows (X_GROUP_BYTES) and the passes after the first are
// compute-bound from L2. Groups hold whole 8-row tiles: the same tiles, the same sums.
void run_whole(const Problem& pr, int threads) {
  const int64_t panels = (pr.n + PANEL - 1) / PANEL;
  const int64_t blocks = (panels + BLOCK_PANELS - 1) / BLOCK_PANELS;
  const int64_t fit_tiles = std::max<int64_t>(X_GROUP_BYTES / (pr.k2 * 4 * TILE_M), 1);
  const int64_t tiles = (pr.m + TILE_M - 1) / TILE_M, groups = (tiles + fit_tiles - 1) / fit_tiles;
  const int64_t group = (tiles + groups - 1) / groups * TILE_M;  // rows: the groups as even as whole tiles allow
#pragma omp parallel num_threads(threads)
  for (int64_t g0 = 0; g0 < pr.m; g0 += group) {
    const int64_t g1 = std::min(g0 + group, pr.m);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t p0 = b * BLOCK_PANELS;
      const int np = block_panels(panels, p0);
      for (int64_t r0 = g0; r0 < g1; r0 += TILE_M) {
        const int mr = static_cast<int>(std::min<int64_t>(g1 - r0, TILE_M));
        pick(mr, np)(pr, r0, p0, 0, pr.k2, nullptr, nullptr);
      }
    }
  }
}

// 2..CHUNKED_TILES row tiles: a block's K in chunks of CHUNK_PAIRS, every tile's pass over a chunk before the
// next chunk, the tiles' partial sums kept in between (fp32, the same K order: the same result). Why: with a
// whole-K pass per tile the first pass waits on memory (the weights stream in) and the others on arithmetic
// (the block is in L2), one after the other. Here each pass over a chunk also fetches its share of the next
// chunk (the thread's next block's first after the last), so the stream runs under the arithmetic.
void run_chunked(const Problem& pr, int threads) {
  const int64_t panels = (pr.n + PANEL - 1) / PANEL;
  const int64_t blocks = (panels + BLOCK_PANELS - 1) / BLOCK_PANELS;
  const int64_t chunks = (pr.k2 + CHUNK_PAIRS - 1) / CHUNK_PAIRS;
  const int tiles = static_cast<int>((pr.m + TILE_M - 1) / TILE_M);
  const int64_t panel_elems = pr.k2 * 2 * PANEL;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float partial[CHUNKED_TILES][TILE_M * BLOCK_PANELS * PANEL];
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    // the blocks schedule(static) would give this thread: contiguous, the first `blocks % nt` one longer
    const int64_t base = blocks / nt, extra = blocks % nt;
    const int64_t b_begin = t * base + std::min(t, extra);
    const int64_t b_end = b_begin + base + (t < extra ? 1 : 0);
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t p0 = b * BLOCK_PANELS;
      const int np = block_panels(panels, p0);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t kk0 = c * CHUNK_PAIRS, kk1 = chunk_end(kk0, pr.k2);
        NextChunk next{{nullptr, nullptr, nullptr}, 0, 0, 0, tiles};
        int64_t next_p0 = p0, next_kk = kk1;
        if (c + 1 == chunks) {  // the thread's next block, if it has one, from its first chunk
          next_p0 = b + 1 < b_end ? p0 + BLOCK_PANELS : -1;
          next_kk = 0;
        }
        if (next_p0 >= 0) {
          next.np = block_panels(panels, next_p0);
          next.pairs = chunk_end(next_kk, pr.k2) - next_kk;
          for (int j = 0; j < next.np; ++j)
            next.lines[j] = reinterpret_cast<const char*>(pr.wp + (next_p0 + j) * panel_elems + next_kk * 2 * PANEL);
        }
        for (int i = 0; i < tiles; ++i) {
          const int64_t r0 = static_cast<int64_t>(i) * TILE_M;
          const int mr = static_cast<int>(std::min<int64_t>(pr.m - r0, TILE_M));
          next.phase = i;
          pick(mr, np)(pr, r0, p0, kk0, kk1, partial[i], next_p0 >= 0 ? &next : nullptr);
        }
      }
    }
  }
}

void run_avx512(const Problem& pr, int threads) {
  const int64_t tiles = (pr.m + TILE_M - 1) / TILE_M;
  if (tiles >= 2 && tiles <= CHUNKED_TILES) run_chunked(pr, threads);
  else run_whole(pr, threads);
}

void run_scalar(const Problem& pr, int threads) {
  const int64_t panels = (pr.n + PANEL - 1) / PANEL;
  const int64_t panel_elems = pr.k2 * 2 * PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t r = 0; r < pr.m; ++r) {
      float acc[PANEL] = {};
      const uint16_t* xr = pr.x + r * pr.ldx;
      for (int64_t kk = 0; kk < pr.k2; ++kk) {
        const float x0 = bf16_to_f32(xr[2 * kk]), x1 = bf16_to_f32(xr[2 * kk + 1]);
        const uint16_t* w = pr.wp + p * panel_elems + kk * 2 * PANEL;
        for (int j = 0; j < PANEL; ++j) acc[j] += x0 * bf16_to_f32(w[2 * j]) + x1 * bf16_to_f32(w[2 * j + 1]);
      }
      for (int j = 0; j < PANEL && p * PANEL + j < pr.n; ++j) {
        const int64_t c = p * PANEL + j;
        const float v = acc[j] + (pr.bias ? pr.bias[c] : 0.0f);
        if (pr.out_f32) pr.out_f32[r * pr.ldo + c] = pr.round_f32 ? bf16_to_f32(f32_to_bf16(v)) : v;
        else pr.out_bf16[r * pr.ldo + c] = f32_to_bf16(v);
      }
    }
  }
}

}  // namespace

extern "C" {

int kubeinfer_bf16_gemm_abi() { return 2; }

// 1: avx512bf16, 0: scalar. Returns the path in use (1 only if this build can run it).
int kubeinfer_bf16_set_path(int path) {
  g_path = path == 1 ? 1 : 0;
  return g_path;
}

// w [n, k] bf16 (row stride ldw) -> packed [ceil(n/16), ceil(k/2), 16, 2] bf16, zero-padded.
int kubeinfer_bf16_pack(const uint16_t* w, int64_t n, int64_t k, int64_t ldw, uint16_t* packed, int threads) {
  if (!w || !packed || n <= 0 || k <= 0 || ldw < k) return 1;
  const int64_t panels = (n + PANEL - 1) / PANEL, k2 = (k + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint16_t* dst = packed + p * k2 * 2 * PANEL;
    for (int64_t kk = 0; kk < k2; ++kk)
      for (int j = 0; j < PANEL; ++j)
        for (int t = 0; t < 2; ++t) {
          const int64_t row = p * PANEL + j, col = 2 * kk + t;
          dst[(kk * PANEL + j) * 2 + t] = (row < n && col < k) ? w[row * ldw + col] : 0;
        }
  }
  return 0;
}

// out = x @ W^T (+ bias); x [m, 2 k2] bf16 (row stride ldx, values past K zero); exactly one of
// out_bf16 / out_f32 non-null, [m, n] with row stride ldo; round_f32 (out_f32 only): each fp32 value is
// the bf16 one widened, what out_bf16 then a widening pass would give, without that pass.
int kubeinfer_bf16_linear(const uint16_t* packed, int64_t n, int64_t k2, const uint16_t* x, int64_t m,
                          int64_t ldx, const float* bias, uint16_t* out_bf16, float* out_f32, int64_t ldo,
                          int threads, int round_f32) {
  if (!packed || !x || n <= 0 || k2 <= 0 || m < 0 || ldx < 2 * k2 || ldo < n) return 1;
  if ((out_bf16 == nullptr) == (out_f32 == nullptr)) return 2;
  if (round_f32 && !out_f32) return 3;
  if (m == 0) return 0;
  const Problem pr{packed, n, k2, x, m, ldx, bias, out_bf16, out_f32, ldo, round_f32 != 0};
  const int t = threads > 0 ? threads : 1;
  if (g_path == 1) run_avx512(pr, t);
  else run_scalar(pr, t);
  return 0;
}

}  // extern "C"
