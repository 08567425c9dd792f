// y[M, N] = Q8K(x)[M, K] @ W[N, K]^T over GGUF's own k-quant super-blocks (block_q4_K, block_q6_K), held
// as the file's bytes: no repack, the resident bits per weight are the file's (4.5 and 6.5625).
//
// Block layouts (ggml/src/ggml-common.h; gguf-py's quants.py reads them the same way), 256 values each:
//   block_q4_K {fp16 d; fp16 dmin; u8 scales[12]; u8 qs[128]}  w = d*sc_j*q - dmin*m_j, j = k / 32,
//     sc_j/m_j 6-bit (ggml's get_scale_min_k4), qs[32c + l]: k = 64c + l (low nibble), 64c + 32 + l (high)
//   block_q6_K {u8 ql[128]; u8 qh[64]; s8 scales[16]; fp16 d}  w = d*sc_j*(q - 32), j = k / 16, q 6-bit:
//     per 128-half h, l < 32: k = 128h + l      : ql[64h + l] & 15  | (qh[32h + l] >> 0 & 3) << 4
//                             k = 128h + 32 + l : ql[64h+32+l] & 15 | (qh[32h + l] >> 2 & 3) << 4
//                             k = 128h + 64 + l : ql[64h + l] >> 4  | (qh[32h + l] >> 4 & 3) << 4
//                             k = 128h + 96 + l : ql[64h+32+l] >> 4 | (qh[32h + l] >> 6 & 3) << 4
//
// Q4_K x16 (FMT_Q4_K_X16): the same super-blocks re-laid at load for 16 weight rows at a time, so that one
// `vpdpbusd` serves 16 output rows (one per int32 lane) instead of 16 k of one row: no horizontal sums,
// and one sub-block scale per lane. Tile = 16 rows x one super-block, 2368 bytes (148 per row: 4.625
// bits/weight), the tiles of rows 16t..16t+15 one after another in k, so a [N, K / 256 * 148] byte tensor
// holds whole tiles in its rows 16t..16t+15 (N a multiple of 16):
//   +0    fp16 d[16]            +32   fp16 dmin[16]
//   +64   u8 sc[8][16]          sc[j][r]: sub-block j's 6-bit scale of row r
//   +192  u8 mn[4][16][2]       mn[p][r] = {m[2p][r], m[2p + 1][r]}: int16 pairs for `vpdpwssd`
//   +320  u8 qs[8][4][64]       qs[j][g][4r + i] = q[r][32j + 4g + i] | q[r][32j + 16 + 4g + i] << 4
// Q6_K x16 (FMT_Q6_K_X16), likewise: tile = 16 rows x one super-block, 3360 bytes (210 per row, the file's
// 6.5625 bits/weight):
//   +0    fp16 d[16]
//   then per 32-value chunk J = 0..7, 416 bytes at 32 + 416 J (so that a pass reads the tile in order):
//   +0    s8 sc[16][2]          sc[r] = {scale of sub-block 2J, of 2J + 1} of row r (16-value sub-blocks)
//   +32   u8 ql[4][64]          ql[g][4r + i] = low 4 bits of q[r][32J + 4g + i] | of q[r][32J + 16 + 4g + i] << 4
//   +288  u8 qh[2][64]          qh[h][4r + i] bits 2g..2g+1 = top 2 bits of q[r][32J + 16h + 4g + i]
// (q the 6-bit value before the -32 offset). kubeinfer_qk_interleave writes both layouts from the file's
// rows; cpu_qk_native.interleave_reference is its torch twin. Descriptors mark tiles by group_size
// X16_GROUP (16 rows x 256), the files' row-major blocks by 256.
// Q8_0 x16 (FMT_Q8_0_X16): 8-bit values in 32-value blocks with one fp16 scale each, w = d * q (GGUF's
// block_q8_0), 16 rows per tile over the whole row: nb = K / 32 blocks, 34 bytes per row per block (the file's 8.5
// bits/weight), the values first so that each block's 512 bytes start on a cache line:
//   +512 b           u8 qs[8][64]   qs[g][4r + i] = q[r][32b + 4g + i] + 128 (= q ^ 0x80)
//   +512 nb + 32 b   fp16 d[16]     d[r]: row r's scale of block b
// so a [N, K / 32 * 34] byte tensor holds tile t in its rows 16t..16t+15 (cpu_qlinear.interleave_q8_x16
// writes it, in torch). Its activations are ggml's Q8_0 ones (per 32 values, the int8 GEMV's in
// csrc/qgemv_q8.cpp): vpdpbusd multiplies u8 by s8, so the weights are held as q + 128 and 128 * sum(q_x)
// comes off each block's int32 sum, exact. Descriptors mark these tiles by group_size Q8X_GROUP (16 rows x 32)
// and row_bytes k / 32 * 34.
// Q5_0 x16 (FMT_Q5_0_X16): GGUF's block_q5_0 (w = d * (q - 16), q 5-bit) in the same tiles at the file's 22
// bytes per row per block (5.5 bits/weight):
//   +320 b           u8 qs[4][64]   qs[g][4r + i] = low 4 bits of q[r][32b + 4g + i] | of q[r][32b + 16 + 4g + i] << 4
//   +320 b + 256     u64 qh[8]      bit 4r + i of qh[g] = bit 4 of q[r][32b + 4g + i]
//   +320 nb + 32 b   fp16 d[16]
// unpacked in registers to u8 q (0..31: a nibble mask, and 16 added under qh's bit mask), 16 sum(q_x) off.
// Descriptors: group_size Q8X_GROUP, row_bytes k / 32 * 22.
// IQ4_NL x16 (FMT_IQ4_NL_X16): GGUF's block_iq4_nl (w = d * kvalues_iq4nl[idx], idx 4-bit) at the file's 18
// bytes per row per block (4.5 bits/weight): Q5_0's nibble vectors of the indices, no qh:
//   +256 b           u8 qs[4][64]   qs[g][4r + i] = idx of (r, 32b + 4g + i) | idx of (r, 32b + 16 + 4g + i) << 4
//   +256 nb + 32 b   fp16 d[16]
// each index looked up (vpshufb) to its level + 128 in registers, then dotted as Q8_0's values.
// Q5_1 x16 (FMT_Q5_1_X16): GGUF's block_q5_1 (w = d * q + m, q 5-bit unsigned) at the file's 24 bytes per row
// per block (6.0 bits/weight): Q5_0's 320 bytes of values per block, then d and m:
//   +320 nb + 64 b       fp16 d[16]
//   +320 nb + 64 b + 32  fp16 m[16]
// the values (0..31) dotted as they are; per block y += d dx dot + m dx sum(q_x).
// Descriptors: group_size Q8X_GROUP, row_bytes k / 32 * 18 (IQ4_NL) or 24 (Q5_1).
// Q5_K, IQ4_XS, Q3_K, Q2_K x16 (FMT_Q5_K_X16 .. FMT_Q2_K_X16): 16 rows x one super-block, the file's bits
// per weight or within 1/8 bit of them; value (r, k = 32J + 16h + 4g + i) always at byte 4r + i of a
// 64-byte vector, so that one vpdpbusd serves 16 rows (kubeinfer_qk_interleave writes them from the file's
// blocks, kubeinfer_qk_deinterleave gives those back byte for byte):
//   Q5_K (block_q5_K: Q4_K's fields + a fifth bit per value; 2880 bytes, 180 per row, 5.625 bits/weight
//   against the file's 5.5): Q4_K x16's layout, then +2368 u8 qh[8][64], bit 4h + g of qh[J][4r + i] =
//   the fifth bit of value (r, J, h, g, i)
//   IQ4_XS (block_iq4_xs: fp16 d, 6-bit ls per 32 values, 4-bit indices into ggml's kvalues_iq4nl,
//   w = d (ls - 32) level; 2208 bytes, 138 per row, 4.3125 against 4.25):
//   +0 fp16 d[16]   +32 s8 s[4][16][2] = ls - 32 of sub-blocks 2p, 2p + 1 of row r
//   +160 u8 qs[8][4][64]   qs[J][g][4r + i] = index of (r, J, 0, g, i) | of (r, J, 1, g, i) << 4
//   Q3_K (block_q3_K: fp16 d, 6-bit scales per 16 values, 3-bit q, w = d (sc - 32) (q - 4); 1824 bytes,
//   114 per row, 3.5625 against 3.4375): +0 fp16 d[16], then per chunk J a 224-byte run at 32 + 224 J:
//   +0 s8 sc[16][2] = sc - 32 of sub-blocks 2J, 2J + 1 of row r
//   +32 u8 lo[2][64]   bits 2g..2g+1 of lo[h][4r + i] = the low 2 bits of (r, J, h, g, i)
//   +160 u8 hb[64]     bit 4h + g of hb[4r + i] = its high bit (q = low + 4 high, 0..7)
//   Q2_K (block_q2_K: fp16 d, dmin, 4-bit scales and mins per 16 values, 2-bit q, w = d sc q - dmin m;
//   1344 bytes, 84 per row: the file's 2.625): +0 fp16 d[16], +32 fp16 dmin[16], then per chunk J a
//   160-byte run at 64 + 160 J: +0 u8 sm[16][2] = sc | m << 4 of sub-blocks 2J, 2J + 1 of row r,
//   +32 u8 lo[2][64] as Q3_K's.
// Descriptors: group_size X16_GROUP, row_bytes k / 256 * 180, 138, 114 or 84.
//
// Activations: ggml's q8_K idea. Each row of x is quantized per 256-value block to int8 with one fp32
// scale, dx = max|x_b| / 127, q = round-half-even(x * (1 / dx)) (fp32), plus the sums of q per 16
// values for the min (Q4_K) and offset (Q6_K) terms. Per super-block of a weight row:
//   Q4_K: d dx sum_j sc_j dot_j(q_w, q_x)  -  dmin dx sum_j m_j sum_{k in j} q_x
//   Q6_K: d dx sum_j sc_j (dot_j(q_w, q_x) - 32 sum_{k in j} q_x)
// with the dot products and their scaled sums in int32 (|.| < 2^25: exact), so the result is W @ x^ for
// x^ = dx q the activation as quantized, up to fp32 rounding (cpu_qk_native.linear_reference).
//
// Code paths, chosen at run time (kubeinfer_qk_set_path from Python's usable CPU features, lowered to
// what libgcc's CPUID check reports):
//   vnni    AVX512-VNNI `vpdpbusd` on 512-bit vectors: the weights unpacked to u8 (0..15 or 0..63) in k
//           order, four vectors per super-block, dotted with the s8 activations; each lane's int32 sum
//           times its sub-block's scale by `vpdpwssd` where it fits int16 (|.| < 2^15: Q4_K, Q3_K, Q2_K),
//           else `vpmulld` (Q6_K, Q5_K < 2^17, IQ4_XS < 2^20), the min and offset terms as int32 vectors
//           too, one fp32 vector per row of x reduced once per output (the x16 tiles: none, 16 lanes = 16
//           outputs).
//   avx2    the 16-row tiles only (row-major blocks run scalar there): the vnni tile kernels' own text
//           compiled for AVX2 (the shims after the kernels), `vpmaddubsw` + `vpmaddwd` for `vpdpbusd`, each
//           64-byte tile vector as two 32-byte halves of 8 rows; bit for bit the vnni path's results.
//   scalar  plain C++, any CPU.
// Batches: each weight row's super-block is unpacked once and dotted with up to TILE_M rows of x while it
// sits in registers; a batch of M rows reads every weight byte from memory once (from L1 again for each
// further tile of TILE_M rows). Threads split the output columns (weight rows).
#if !defined(KI_QK_KERNELS)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KI_QK_X86 1
#define KI_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define KI_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define KI_QK_X86 0
#endif

namespace {

constexpr int QK_K = 256;
constexpr int FMT_Q4_K = 0, FMT_Q6_K = 1, FMT_Q4_K_X16 = 2, FMT_Q6_K_X16 = 3;
constexpr int64_t Q4_K_BYTES = 144, Q6_K_BYTES = 210;
constexpr int64_t X16_ROWS = 16, X16_TILE_BYTES = 2368, X16_ROW_BYTES = 148;  // 16 x 148 = 2368
constexpr int X16_SC = 64, X16_MN = 192, X16_QS = 320;  // offsets in a Q4_K tile
constexpr int64_t Q6X_TILE_BYTES = 3360, X16_GROUP = 16 * 256;
// offsets in a Q6_K tile: after d, one 416-byte run per 32-value chunk J (scales, ql, qh), read in order
constexpr int Q6X_RUN = 416;
constexpr int q6x_sc(int J) { return 32 + Q6X_RUN * J; }
constexpr int q6x_ql(int J, int g) { return 32 + Q6X_RUN * J + 32 + 64 * g; }
constexpr int q6x_qh(int J, int h) { return 32 + Q6X_RUN * J + 288 + 64 * h; }
// ggml's kvalues_iq4nl (ggml-common.h): IQ4_XS's (and IQ4_NL's) 16 levels; + 128 as the tiles' u8 values
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// 32-value blocks in 16-row tiles (layouts in the header); the codes after the 256-value ones' (10..13)
constexpr int FMT_Q8_0_X16 = 4, FMT_Q5_0_X16 = 5, FMT_IQ4_NL_X16 = 14, FMT_Q5_1_X16 = 15;
constexpr int64_t Q8X_BLOCK = 32, Q8X_ROW_BYTES = 34, Q5X_ROW_BYTES = 22, Q8X_GROUP = 16 * 32;
constexpr int64_t IQ4NLX_ROW_BYTES = 18, Q51X_ROW_BYTES = 24;
constexpr bool q32_format(int fmt) {
  return fmt == FMT_Q8_0_X16 || fmt == FMT_Q5_0_X16 || fmt == FMT_IQ4_NL_X16 || fmt == FMT_Q5_1_X16;
}
// Per 32-block tile format: bytes of one block's values (16 rows), of its scales (fp16 d, Q5_1's fp16 m
// after them), bytes per row per block, the offset the stored value carries (w = d * (value - offset)
// [+ m]), and the factor of sum(q_x) the kernels keep per block of x (QuantizedX32::st): the offset's, or
// Q5_1's plain sum for its min term.
constexpr bool q32_has_qh(int fmt) { return fmt == FMT_Q5_0_X16 || fmt == FMT_Q5_1_X16; }
constexpr int64_t q32_values_bytes(int fmt) { return q32_has_qh(fmt) ? 320 : fmt == FMT_IQ4_NL_X16 ? 256 : 512; }
constexpr int64_t q32_scale_bytes(int fmt) { return fmt == FMT_Q5_1_X16 ? 64 : 32; }
constexpr int64_t q32_row_bytes(int fmt) { return (q32_values_bytes(fmt) + q32_scale_bytes(fmt)) / 16; }
constexpr int32_t q32_offset(int fmt) { return fmt == FMT_Q5_0_X16 ? 16 : fmt == FMT_Q5_1_X16 ? 0 : 128; }
constexpr int32_t q32_sum_factor(int fmt) { return fmt == FMT_Q5_1_X16 ? 1 : q32_offset(fmt); }
static_assert(q32_row_bytes(FMT_Q8_0_X16) == Q8X_ROW_BYTES && q32_row_bytes(FMT_Q5_0_X16) == Q5X_ROW_BYTES);
static_assert(q32_row_bytes(FMT_IQ4_NL_X16) == IQ4NLX_ROW_BYTES && q32_row_bytes(FMT_Q5_1_X16) == Q51X_ROW_BYTES);
// The stored value (Q8_0 q + 128, IQ4_NL level + 128, Q5_0 / Q5_1 0..31) of row r, k = 32b + 4g + i, in
// one block's values `v` of a tile.
inline int q32_value(int fmt, const uint8_t* v, int r, int g, int i) {
  if (fmt == FMT_Q8_0_X16) return v[64 * g + 4 * r + i];
  const uint8_t byte = v[64 * (g & 3) + 4 * r + i];
  const int nib = g < 4 ? byte & 15 : byte >> 4;
  if (fmt == FMT_IQ4_NL_X16) return IQ4_VALUES[nib] + 128;
  const int e = 4 * r + i;
  return nib | (((v[256 + 8 * g + e / 8] >> (e % 8)) & 1) << 4);
}
// The other k-quant types in 16-row tiles of 256-value super-blocks (layouts in the header): file rows in
// (kubeinfer_qk_interleave's FMT_*_ROWS codes), tiles run.
constexpr int FMT_Q5_K_X16 = 6, FMT_IQ4_XS_X16 = 7, FMT_Q3_K_X16 = 8, FMT_Q2_K_X16 = 9;
constexpr int FMT_Q5_K_ROWS = 10, FMT_IQ4_XS_ROWS = 11, FMT_Q3_K_ROWS = 12, FMT_Q2_K_ROWS = 13;
constexpr int64_t Q5_K_BYTES = 176, IQ4_XS_BYTES = 136, Q3_K_BYTES = 110, Q2_K_BYTES = 84;  // the files'
constexpr int64_t Q5X_TILE_BYTES = 2880, IQ4X_TILE_BYTES = 2208, Q3X_TILE_BYTES = 1824, Q2X_TILE_BYTES = 1344;
constexpr int Q5X_QH = 2368, IQ4X_S = 32, IQ4X_QS = 160;        // offsets in a Q5_K / IQ4_XS tile
constexpr int Q3X_RUN = 224, Q3X_BASE = 32, Q2X_RUN = 160, Q2X_BASE = 64;  // per-chunk runs of Q3_K / Q2_K
inline bool new_tiles(int fmt) { return fmt >= FMT_Q5_K_X16 && fmt <= FMT_Q2_K_X16; }
inline int64_t tile_bytes(int fmt) {
  switch (fmt) {
    case FMT_Q4_K_X16: return X16_TILE_BYTES;
    case FMT_Q6_K_X16: return Q6X_TILE_BYTES;
    case FMT_Q5_K_X16: return Q5X_TILE_BYTES;
    case FMT_IQ4_XS_X16: return IQ4X_TILE_BYTES;
    case FMT_Q3_K_X16: return Q3X_TILE_BYTES;
    default: return Q2X_TILE_BYTES;
  }
}
inline int64_t file_block_bytes(int tiles_fmt) {  // the file's block of a new tile format's type
  return tiles_fmt == FMT_Q5_K_X16 ? Q5_K_BYTES : tiles_fmt == FMT_IQ4_XS_X16 ? IQ4_XS_BYTES
         : tiles_fmt == FMT_Q3_K_X16 ? Q3_K_BYTES : Q2_K_BYTES;
}
// Whether a 256-value tile format's x16 kernel takes the activations' sums per 32 values as int16 pairs
// (Q4_K, Q5_K, IQ4_XS: 32-value sub-blocks) or per 16 (Q6_K, Q3_K, Q2_K).
inline bool pairs_per_32(int fmt) {
  return fmt == FMT_Q4_K_X16 || fmt == FMT_Q5_K_X16 || fmt == FMT_IQ4_XS_X16;
}
constexpr int TILE_M = 8;  // rows of x per pass over a weight row's super-block
constexpr int PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_VNNI = 2;
int path_in_use = PATH_SCALAR;

inline float fp16_to_fp32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ggml's get_scale_min_k4 for all eight sub-blocks: sc[j], mn[j] in 0..63.
inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// One row of x per 256-block: q (k order), dx, and the sums of q per 16 values.
struct QuantizedX {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K / 256]
  std::vector<int32_t> bsum;  // [M, K / 16]
  // [M, K / 256, 16]: the vnni path's per-block sums (Q4_K: 8 zeros, then the 8 per-32 sums; Q6_K: bsum)
  std::vector<int32_t> sums;
  // [M, K / 256, 4 or 8]: the x16 kernels' second operand as int16 pairs: per-32 sums of sub-blocks 2p and
  // 2p + 1 for Q4_K / Q5_K (their mins' term) and IQ4_XS (its +128 offset's), per-16 sums for Q6_K / Q3_K
  // (their -32 / -4 offsets') and Q2_K (its mins')
  std::vector<int32_t> pairs;
};

void quantize_rows(int fmt, const float* x, int64_t m, int64_t ldx, int64_t k, QuantizedX& out) {
  const int64_t nb = k / QK_K;
  out.q.resize(m * k);
  out.d.resize(m * nb);
  out.bsum.resize(m * (k / 16));
  out.sums.resize(m * (k / 16));
  const bool tiles = fmt == FMT_Q4_K_X16 || fmt == FMT_Q6_K_X16 || new_tiles(fmt);
  if (tiles) out.pairs.resize(m * nb * (pairs_per_32(fmt) ? 4 : 8));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * ldx + b * QK_K;
      float amax = 0.0f;
      for (int i = 0; i < QK_K; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f;
      const float id = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = out.q.data() + r * k + b * QK_K;
      for (int i = 0; i < QK_K; ++i) q[i] = (int8_t)std::nearbyint(xb[i] * id);
      out.d[r * nb + b] = d;
      int32_t* s = out.bsum.data() + r * (k / 16) + b * 16;
      for (int j = 0; j < 16; ++j) {
        int32_t t = 0;
        for (int i = 0; i < 16; ++i) t += q[16 * j + i];
        s[j] = t;
      }
      int32_t* v = out.sums.data() + r * (k / 16) + b * 16;
      for (int j = 0; j < 16; ++j) v[j] = fmt == FMT_Q6_K ? s[j] : j < 8 ? 0 : s[2 * (j - 8)] + s[2 * (j - 8) + 1];
      if (tiles && !pairs_per_32(fmt)) {
        int32_t* pr = out.pairs.data() + (r * nb + b) * 8;
        for (int p = 0; p < 8; ++p)  // |sum of 16 q| <= 2032
          pr[p] = (int32_t)(((uint32_t)(uint16_t)(int16_t)s[2 * p]) | ((uint32_t)(uint16_t)(int16_t)s[2 * p + 1] << 16));
      }
      if (tiles && pairs_per_32(fmt)) {
        int32_t* pr = out.pairs.data() + (r * nb + b) * 4;
        for (int p = 0; p < 4; ++p) {  // |sum of 32 q| <= 4064: fits int16
          const int32_t lo = s[4 * p] + s[4 * p + 1], hi = s[4 * p + 2] + s[4 * p + 3];
          pr[p] = (int32_t)(((uint32_t)(uint16_t)(int16_t)lo) | ((uint32_t)(uint16_t)(int16_t)hi << 16));
        }
      }
    }
  }
}

// One row of x per 32-block (the 32-value tiles): q (k order) and dx per block (the scalar path's).
struct QuantizedX32 {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, K / 32]
  // The vnni path's copy, per block of TILE_M rows (zero past M) so that a pass reads one stream with fixed
  // offsets: xi [M / 8, K / 32, 8, 8] the dwords (4 q each, g-major), dt and st [M / 8, K / 32, 8]
  // dx and q32_sum_factor * sum(q)
  std::vector<int32_t> xi, st;
  std::vector<float> dt;
};

// One 32-block of x as ggml's quantize_row_q8_0 computes it (cpu_qgemv_q8.quantize_activations_reference):
// dx = max|x| / 127, q = round-half-even(x * (1 / dx)), q = 0 where dx = 0; and sum(q).
inline void quantize_block32(const float* x, int8_t* q, float& d, int32_t& sum) {
  float amax = 0.0f;
  for (int i = 0; i < Q8X_BLOCK; ++i) amax = std::max(amax, std::fabs(x[i]));
  d = amax / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  int32_t t = 0;
  for (int i = 0; i < Q8X_BLOCK; ++i) {
    q[i] = (int8_t)std::nearbyint(x[i] * id);
    t += q[i];
  }
  sum = t;
}

#if KI_QK_X86
// The same in AVX-512, bit for bit: the same fp32 division and products, cvt's round-to-nearest-even.
KI_VNNI void quantize_block32_avx512(const float* x, int8_t* q, float& d, int32_t& sum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.0f;
  const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(qb));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

// And in AVX2, bit for bit too: cvtps rounds by MXCSR, round-to-nearest-even as nearbyint's default mode.
KI_AVX2 void quantize_block32_avx2(const float* x, int8_t* q, float& d, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  d = _mm_cvtss_f32(m4) / 127.0f;
  const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
  // packs interleave the 128-bit lanes: dwords 0, 4, 1, 5, 2, 6, 3, 7 after the two packs, put back in order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  sum = _mm_cvtsi128_si32(s4);
}
#endif

// Every row of x per 32-block into `out` (both layouts), rows split over `threads` (the scalar loop cost a
// 16-row decode step of Gemma-3-1B ~10% when it ran on one thread before the tiles' parallel region).
void quantize_rows32(int fmt, const float* x, int64_t m, int64_t ldx, int64_t k, QuantizedX32& out, int path,
                     int threads) {
  const int64_t nb = k / Q8X_BLOCK, blocks = (m + TILE_M - 1) / TILE_M;
  out.q.resize(m * k);
  out.d.resize(m * nb);
  out.xi.assign(blocks * nb * 8 * TILE_M, 0);
  out.st.assign(blocks * nb * TILE_M, 0);
  out.dt.assign(blocks * nb * TILE_M, 0.0f);
  (void)path;
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static) if (m * k >= (1 << 14))
  for (int64_t r = 0; r < m; ++r) {
    const int64_t rb = r / TILE_M, i = r % TILE_M;
    for (int64_t b = 0; b < nb; ++b) {
      int8_t* q = out.q.data() + r * k + b * Q8X_BLOCK;
      float d;
      int32_t sum;
#if KI_QK_X86
      if (path == PATH_VNNI)
        quantize_block32_avx512(x + r * ldx + b * Q8X_BLOCK, q, d, sum);
      else if (path == PATH_AVX2)
        quantize_block32_avx2(x + r * ldx + b * Q8X_BLOCK, q, d, sum);
      else
#endif
        quantize_block32(x + r * ldx + b * Q8X_BLOCK, q, d, sum);
      out.d[r * nb + b] = d;
      const int64_t at = (rb * nb + b) * TILE_M + i;
      for (int g = 0; g < 8; ++g) std::memcpy(&out.xi[((rb * nb + b) * 8 + g) * TILE_M + i], q + 4 * g, 4);
      out.st[at] = q32_sum_factor(fmt) * sum;
      out.dt[at] = d;
    }
  }
}

// Q4_K's 256 four-bit values in k order: each 32 bytes of `qs` hold 64 values, the low nibbles first
// (sub-block 2c) and the high nibbles second (sub-block 2c + 1), as ggml's block_q4_K lays them out.
inline void q4k_values(const uint8_t* blk, uint8_t* v) {
  const uint8_t* qs = blk + 16;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      v[64 * c + l] = qs[32 * c + l] & 15;
      v[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
}

// Q6_K's 256 six-bit values (0..63, before the -32 offset) in k order: ggml's block_q6_K keeps each
// value's low 4 bits in `ql` (two halves of 128) and its top 2 bits in `qh`, four values per qh byte.
inline void q6k_values(const uint8_t* blk, uint8_t* v) {
  const uint8_t *ql = blk, *qh = blk + 128;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = ql[64 * h + l], c = ql[64 * h + 32 + l], e = qh[32 * h + l];
      v[128 * h + l] = (a & 15) | ((e & 3) << 4);
      v[128 * h + 32 + l] = (c & 15) | (((e >> 2) & 3) << 4);
      v[128 * h + 64 + l] = (a >> 4) | (((e >> 4) & 3) << 4);
      v[128 * h + 96 + l] = (c >> 4) | (((e >> 6) & 3) << 4);
    }
}

// ------------------------------------------------------------------ Q5_K, IQ4_XS, Q3_K, Q2_K: one row's fields

// One row's super-block as the x16 kernels see it, whatever its type: w_k = d s_j (v_k - off) - dmin m_j
// for k in 16-value sub-block j (off: Q3_K 4, IQ4_XS 128, else 0), v_k = code_value(code_k); the fp16
// scales' bits as stored, so that a block goes back to its file bytes exactly.
struct KFields {
  uint16_t d = 0, dmin = 0;
  int16_t s[16] = {0};    // Q5_K's 6-bit scale, Q3_K's and IQ4_XS's (scale - 32), Q2_K's 4-bit scale
  int16_t m[16] = {0};    // Q5_K's 6-bit min, Q2_K's 4-bit min, else 0
  uint8_t code[QK_K];     // the stored code: Q5_K 0..31, Q3_K 0..7 (low 2 bits | high bit << 2), Q2_K 0..3,
                          // IQ4_XS the 0..15 index into IQ4_VALUES
};

inline int32_t k_offset(int fmt) { return fmt == FMT_Q3_K_X16 ? 4 : fmt == FMT_IQ4_XS_X16 ? 128 : 0; }
// The unsigned value the kernels multiply: IQ4_XS's level + 128, else the code.
inline int32_t code_value(int fmt, uint8_t c) { return fmt == FMT_IQ4_XS_X16 ? IQ4_VALUES[c] + 128 : c; }
inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline float fp16_bits(uint16_t h) {
  uint8_t b[2];
  std::memcpy(b, &h, 2);
  return fp16_to_fp32(b);
}

// A file block of `tiles_fmt`'s type (ggml-common.h's block_q5_K, block_iq4_xs, block_q3_K, block_q2_K) ->
// its fields. Value k's bits: Q5_K low nibble as Q4_K, fifth bit = bit k / 32 of qh[k % 32]; IQ4_XS per
// 32 values j, 16 bytes: k = 32j + l low nibble, 32j + 16 + l high; Q3_K / Q2_K per 128 h, 32 l, shift
// 2s: k = 128h + 32s + l, Q3_K's high bit = bit k / 32 of hmask[k % 32] (ggml adds -4 where it is clear).
void decode_block(int tiles_fmt, const uint8_t* blk, KFields& f) {
  if (tiles_fmt == FMT_Q5_K_X16) {
    f.d = u16_at(blk);
    f.dmin = u16_at(blk + 2);
    uint8_t sc[8], mn[8];
    q4k_scales(blk + 4, sc, mn);
    for (int j = 0; j < 16; ++j) f.s[j] = sc[j / 2], f.m[j] = mn[j / 2];
    const uint8_t *qh = blk + 16, *qs = blk + 48;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        f.code[64 * c + l] = (uint8_t)((qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4));
        f.code[64 * c + 32 + l] = (uint8_t)((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
      }
  } else if (tiles_fmt == FMT_IQ4_XS_X16) {
    f.d = u16_at(blk);
    const uint16_t sh = u16_at(blk + 2);
    for (int j = 0; j < 8; ++j) {
      const int ls = ((blk[4 + j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4);
      f.s[2 * j] = f.s[2 * j + 1] = (int16_t)(ls - 32);
      for (int l = 0; l < 16; ++l) {
        f.code[32 * j + l] = blk[8 + 16 * j + l] & 15;
        f.code[32 * j + 16 + l] = blk[8 + 16 * j + l] >> 4;
      }
    }
  } else if (tiles_fmt == FMT_Q3_K_X16) {
    const uint8_t *hm = blk, *qs = blk + 32, *sc = blk + 96;
    f.d = u16_at(blk + 108);
    for (int j = 0; j < 16; ++j) {
      const int lo = (j < 8 ? sc[j] : sc[j - 8] >> 4) & 15, hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
      f.s[j] = (int16_t)((lo | (hi << 4)) - 32);
    }
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const int kk = 128 * h + 32 * s + l;
          f.code[kk] = (uint8_t)(((qs[32 * h + l] >> (2 * s)) & 3) | (((hm[l] >> (kk / 32)) & 1) << 2));
        }
  } else {  // Q2_K
    const uint8_t* qs = blk + 16;
    f.d = u16_at(blk + 80);
    f.dmin = u16_at(blk + 82);
    for (int j = 0; j < 16; ++j) f.s[j] = blk[j] & 15, f.m[j] = blk[j] >> 4;
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) f.code[128 * h + 32 * s + l] = (qs[32 * h + l] >> (2 * s)) & 3;
  }
}

// decode_block's inverse: the fields -> the file's block bytes.
void encode_block(int tiles_fmt, const KFields& f, uint8_t* blk) {
  if (tiles_fmt == FMT_Q5_K_X16) {
    std::memset(blk, 0, Q5_K_BYTES);
    put_u16(blk, f.d);
    put_u16(blk + 2, f.dmin);
    for (int j = 0; j < 4; ++j) {  // get_scale_min_k4's inverse
      const int sc_lo = f.s[2 * j], mn_lo = f.m[2 * j], sc_hi = f.s[2 * j + 8], mn_hi = f.m[2 * j + 8];
      blk[4 + j] = (uint8_t)(sc_lo | ((sc_hi >> 4) << 6));
      blk[8 + j] = (uint8_t)(mn_lo | ((mn_hi >> 4) << 6));
      blk[12 + j] = (uint8_t)((sc_hi & 15) | ((mn_hi & 15) << 4));
    }
    uint8_t *qh = blk + 16, *qs = blk + 48;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = f.code[64 * c + l], b = f.code[64 * c + 32 + l];
        qs[32 * c + l] = (uint8_t)((a & 15) | ((b & 15) << 4));
        qh[l] |= (uint8_t)(((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1)));
      }
  } else if (tiles_fmt == FMT_IQ4_XS_X16) {
    std::memset(blk, 0, IQ4_XS_BYTES);
    put_u16(blk, f.d);
    uint16_t sh = 0;
    for (int j = 0; j < 8; ++j) {
      const int ls = f.s[2 * j] + 32;
      blk[4 + j / 2] |= (uint8_t)((ls & 15) << (4 * (j & 1)));
      sh |= (uint16_t)(((ls >> 4) & 3) << (2 * j));
      for (int l = 0; l < 16; ++l)
        blk[8 + 16 * j + l] = (uint8_t)(f.code[32 * j + l] | (f.code[32 * j + 16 + l] << 4));
    }
    put_u16(blk + 2, sh);
  } else if (tiles_fmt == FMT_Q3_K_X16) {
    std::memset(blk, 0, Q3_K_BYTES);
    uint8_t *hm = blk, *qs = blk + 32, *sc = blk + 96;
    put_u16(blk + 108, f.d);
    for (int j = 0; j < 16; ++j) {
      const int v = f.s[j] + 32;
      sc[j % 8] |= (uint8_t)((v & 15) << (j < 8 ? 0 : 4));
      sc[8 + j % 4] |= (uint8_t)(((v >> 4) & 3) << (2 * (j / 4)));
    }
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) {
          const int kk = 128 * h + 32 * s + l;
          qs[32 * h + l] |= (uint8_t)((f.code[kk] & 3) << (2 * s));
          hm[l] |= (uint8_t)((f.code[kk] >> 2) << (kk / 32));
        }
  } else {
    std::memset(blk, 0, Q2_K_BYTES);
    uint8_t* qs = blk + 16;
    put_u16(blk + 80, f.d);
    put_u16(blk + 82, f.dmin);
    for (int j = 0; j < 16; ++j) blk[j] = (uint8_t)(f.s[j] | (f.m[j] << 4));
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) qs[32 * h + l] |= (uint8_t)(f.code[128 * h + 32 * s + l] << (2 * s));
  }
}

// Byte offsets of value (r, J, h, g, i) = k 32J + 16h + 4g + i of row r in a tile: every new tile keeps it
// at byte 4r + i of a 64-byte vector, so that one vpdpbusd serves 16 rows.
inline int lane(int r, int i) { return 4 * r + i; }

// Row r of a tile (layouts in the header) -> its fields.
void read_tile_row(int fmt, const uint8_t* t, int r, KFields& f) {
  f.d = u16_at(t + 2 * r);
  if (fmt == FMT_Q5_K_X16 || fmt == FMT_Q2_K_X16) f.dmin = u16_at(t + 32 + 2 * r);
  for (int J = 0; J < 8; ++J) {
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * J + h;
      if (fmt == FMT_Q5_K_X16) {
        f.s[j] = t[X16_SC + 16 * J + r];
        f.m[j] = t[X16_MN + 32 * (J / 2) + 2 * r + (J & 1)];
      } else if (fmt == FMT_IQ4_XS_X16) {
        f.s[j] = (int8_t)t[IQ4X_S + 32 * (J / 2) + 2 * r + (J & 1)];
      } else if (fmt == FMT_Q3_K_X16) {
        f.s[j] = (int8_t)t[Q3X_BASE + Q3X_RUN * J + 2 * r + h];
      } else {
        const uint8_t sm = t[Q2X_BASE + Q2X_RUN * J + 2 * r + h];
        f.s[j] = sm & 15, f.m[j] = sm >> 4;
      }
      for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 4; ++i) {
          uint8_t c;
          if (fmt == FMT_Q5_K_X16 || fmt == FMT_IQ4_XS_X16) {
            const uint8_t nib = t[(fmt == FMT_Q5_K_X16 ? X16_QS : IQ4X_QS) + (4 * J + g) * 64 + lane(r, i)];
            c = h ? nib >> 4 : nib & 15;
            if (fmt == FMT_Q5_K_X16) c |= (uint8_t)(((t[Q5X_QH + 64 * J + lane(r, i)] >> (4 * h + g)) & 1) << 4);
          } else {
            const uint8_t* run = t + (fmt == FMT_Q3_K_X16 ? Q3X_BASE + Q3X_RUN * J : Q2X_BASE + Q2X_RUN * J);
            c = (run[32 + 64 * h + lane(r, i)] >> (2 * g)) & 3;
            if (fmt == FMT_Q3_K_X16) c |= (uint8_t)(((run[160 + lane(r, i)] >> (4 * h + g)) & 1) << 2);
          }
          f.code[32 * J + 16 * h + 4 * g + i] = c;
        }
    }
  }
}

// The fields -> row r of a tile (read_tile_row's inverse; bits or-ed in: the tile starts zeroed).
void write_tile_row(int fmt, const KFields& f, int r, uint8_t* t) {
  put_u16(t + 2 * r, f.d);
  if (fmt == FMT_Q5_K_X16 || fmt == FMT_Q2_K_X16) put_u16(t + 32 + 2 * r, f.dmin);
  for (int J = 0; J < 8; ++J) {
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * J + h;
      if (fmt == FMT_Q5_K_X16) {
        t[X16_SC + 16 * J + r] = (uint8_t)f.s[j];
        t[X16_MN + 32 * (J / 2) + 2 * r + (J & 1)] = (uint8_t)f.m[j];
      } else if (fmt == FMT_IQ4_XS_X16) {
        t[IQ4X_S + 32 * (J / 2) + 2 * r + (J & 1)] = (uint8_t)(int8_t)f.s[j];
      } else if (fmt == FMT_Q3_K_X16) {
        t[Q3X_BASE + Q3X_RUN * J + 2 * r + h] = (uint8_t)(int8_t)f.s[j];
      } else {
        t[Q2X_BASE + Q2X_RUN * J + 2 * r + h] = (uint8_t)(f.s[j] | (f.m[j] << 4));
      }
      for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 4; ++i) {
          const uint8_t c = f.code[32 * J + 16 * h + 4 * g + i];
          if (fmt == FMT_Q5_K_X16 || fmt == FMT_IQ4_XS_X16) {
            t[(fmt == FMT_Q5_K_X16 ? X16_QS : IQ4X_QS) + (4 * J + g) * 64 + lane(r, i)] |=
                (uint8_t)((c & 15) << (4 * h));
            if (fmt == FMT_Q5_K_X16) t[Q5X_QH + 64 * J + lane(r, i)] |= (uint8_t)((c >> 4) << (4 * h + g));
          } else {
            uint8_t* run = t + (fmt == FMT_Q3_K_X16 ? Q3X_BASE + Q3X_RUN * J : Q2X_BASE + Q2X_RUN * J);
            run[32 + 64 * h + lane(r, i)] |= (uint8_t)((c & 3) << (2 * g));
            if (fmt == FMT_Q3_K_X16) run[160 + lane(r, i)] |= (uint8_t)((c >> 2) << (4 * h + g));
          }
        }
    }
  }
}

// Row i of x against one super-block's fields: d dx sum_j s_j (dot_j - off sum(q_j)) - dmin dx sum_j m_j
// sum(q_j), the integer sums the vnni kernels form. Every scalar path's term for the new tiles.
inline float fields_block_dot(int fmt, const KFields& f, const QuantizedX& xq, int64_t i, int64_t b, int64_t k) {
  const int8_t* q = xq.q.data() + i * k + b * QK_K;
  const int32_t* bs = xq.bsum.data() + i * (k / 16) + b * 16;
  const int32_t off = k_offset(fmt);
  int32_t isum = 0, msum = 0;
  for (int j = 0; j < 16; ++j) {
    int32_t dot = 0;
    for (int l = 0; l < 16; ++l) dot += code_value(fmt, f.code[16 * j + l]) * q[16 * j + l];
    isum += f.s[j] * (dot - off * bs[j]);
    msum += f.m[j] * bs[j];
  }
  const float dx = xq.d[i * (k / QK_K) + b];
  return fp16_bits(f.d) * dx * (float)isum - fp16_bits(f.dmin) * dx * (float)msum;
}

// The fields in fp32 as gguf-py dequantizes the file's block, each product rounded: (d * sc) * q - dmin *
// m (Q5_K, Q2_K), (d * (sc - 32)) * (q - 4) (Q3_K), (d * (ls - 32)) * level (IQ4_XS).
inline void fields_dequant(int fmt, const KFields& f, float* o) {
  const float d = fp16_bits(f.d), dmin = fp16_bits(f.dmin);
  for (int kk = 0; kk < QK_K; ++kk) {
    const int j = kk / 16;
    const float dl = d * (float)f.s[j];
    if (fmt == FMT_Q5_K_X16 || fmt == FMT_Q2_K_X16)
      o[kk] = dl * (float)f.code[kk] - dmin * (float)f.m[j];
    else if (fmt == FMT_Q3_K_X16)
      o[kk] = dl * (float)((int)f.code[kk] - 4);
    else
      o[kk] = dl * (float)IQ4_VALUES[f.code[kk]];
  }
}

// ------------------------------------------------------------------ scalar path

// Row i of x against one Q4_K super-block b (values v in k order, 6-bit scales and mins, d, dmin): ggml's
// integer sums, d dx sum_j sc_j dot_j - dmin dx sum_j mn_j sum(q_j). Every scalar path's Q4_K term.
inline float q4k_block_dot(const uint8_t* v, const uint8_t* sc, const uint8_t* mn, float d, float dmin,
                           const QuantizedX& xq, int64_t i, int64_t b, int64_t k) {
  const int8_t* q = xq.q.data() + i * k + b * QK_K;
  const int32_t* bs = xq.bsum.data() + i * (k / 16) + b * 16;
  int32_t isum = 0, msum = 0;
  for (int j = 0; j < 8; ++j) {
    int32_t dot = 0;
    for (int l = 0; l < 32; ++l) dot += (int32_t)v[32 * j + l] * q[32 * j + l];
    isum += sc[j] * dot;
    msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
  }
  const float dx = xq.d[i * (k / QK_K) + b];
  return d * dx * (float)isum - dmin * dx * (float)msum;
}

// Row i of x against one Q6_K super-block b (six-bit values v, 0..63, in k order; sixteen scales; d):
// d dx sum_j sc_j (dot_j - 32 sum(q_j)). Every scalar path's Q6_K term.
inline float q6k_block_dot(const uint8_t* v, const int8_t* sc, float d, const QuantizedX& xq, int64_t i,
                           int64_t b, int64_t k) {
  const int8_t* q = xq.q.data() + i * k + b * QK_K;
  const int32_t* bs = xq.bsum.data() + i * (k / 16) + b * 16;
  int32_t isum = 0;
  for (int j = 0; j < 16; ++j) {
    int32_t dot = 0;
    for (int l = 0; l < 16; ++l) dot += (int32_t)v[16 * j + l] * q[16 * j + l];
    isum += sc[j] * (dot - 32 * bs[j]);
  }
  return d * xq.d[i * (k / QK_K) + b] * (float)isum;
}

void scalar_rows(int fmt, const uint8_t* w, int64_t n0, int64_t n1, int64_t k, const QuantizedX& xq,
                 int64_t m, float* y, int64_t ldy) {
  const int64_t nb = k / QK_K, bytes = fmt == FMT_Q4_K ? Q4_K_BYTES : Q6_K_BYTES;
  uint8_t v[QK_K];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < m; ++r) y[r * ldy + n] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + (n * nb + b) * bytes;
      if (fmt == FMT_Q4_K) {
        const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        q4k_values(blk, v);
        for (int64_t r = 0; r < m; ++r) y[r * ldy + n] += q4k_block_dot(v, sc, mn, d, dmin, xq, r, b, k);
      } else {
        const int8_t* sc = (const int8_t*)(blk + 192);
        const float d = fp16_to_fp32(blk + 208);
        q6k_values(blk, v);
        for (int64_t r = 0; r < m; ++r) y[r * ldy + n] += q6k_block_dot(v, sc, d, xq, r, b, k);
      }
    }
  }
}


// Row r of a Q4_K x16 tile: d, dmin, the eight 6-bit scales and mins, and the 256 values in k order.
inline void x16_row(const uint8_t* tile, int r, float& d, float& dmin, uint8_t* sc, uint8_t* mn, uint8_t* v) {
  d = fp16_to_fp32(tile + 2 * r);
  dmin = fp16_to_fp32(tile + 32 + 2 * r);
  for (int j = 0; j < 8; ++j) {
    sc[j] = tile[X16_SC + 16 * j + r];
    mn[j] = tile[X16_MN + 32 * (j / 2) + 2 * r + (j & 1)];
  }
  const uint8_t* qs = tile + X16_QS;
  for (int j = 0; j < 8; ++j)
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = qs[(4 * j + g) * 64 + 4 * r + i];
        v[32 * j + 4 * g + i] = byte & 15;
        v[32 * j + 16 + 4 * g + i] = byte >> 4;
      }
}

// Row r of a Q6_K x16 tile: d, the sixteen scales and the 256 six-bit values (0..63) in k order.
inline void q6x_row(const uint8_t* tile, int r, float& d, int8_t* sc, uint8_t* v) {
  d = fp16_to_fp32(tile + 2 * r);
  for (int j = 0; j < 16; ++j) sc[j] = (int8_t)tile[q6x_sc(j / 2) + 2 * r + (j & 1)];
  for (int J = 0; J < 8; ++J)
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 4; ++i) {
        const uint8_t lo = tile[q6x_ql(J, g) + 4 * r + i];
        for (int h = 0; h < 2; ++h) {
          const uint8_t hi = (tile[q6x_qh(J, h) + 4 * r + i] >> (2 * g)) & 3;
          v[32 * J + 16 * h + 4 * g + i] = (uint8_t)(((h ? lo >> 4 : lo) & 15) | (hi << 4));
        }
      }
}

// The scalar path over Q6_K x16 tiles t0..t1: the same integer sums as scalar_rows' Q6_K.
void scalar_q6x_tiles(const uint8_t* w, int64_t t0, int64_t t1, int64_t k, const QuantizedX& xq, int64_t m,
                      float* y, int64_t ldy) {
  const int64_t nb = k / QK_K;
  uint8_t v[QK_K];
  int8_t sc[16];
  for (int64_t t = t0; t < t1; ++t)
    for (int r = 0; r < X16_ROWS; ++r) {
      const int64_t n = X16_ROWS * t + r;
      for (int64_t i = 0; i < m; ++i) y[i * ldy + n] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        float d;
        q6x_row(w + (t * nb + b) * Q6X_TILE_BYTES, r, d, sc, v);
        for (int64_t i = 0; i < m; ++i) y[i * ldy + n] += q6k_block_dot(v, sc, d, xq, i, b, k);
      }
    }
}

// The scalar path over x16 tiles t0..t1: the same integer sums as scalar_rows' Q4_K.
void scalar_x16_tiles(const uint8_t* w, int64_t t0, int64_t t1, int64_t k, const QuantizedX& xq, int64_t m,
                      float* y, int64_t ldy) {
  const int64_t nb = k / QK_K;
  uint8_t v[QK_K], sc[8], mn[8];
  for (int64_t t = t0; t < t1; ++t)
    for (int r = 0; r < X16_ROWS; ++r) {
      const int64_t n = X16_ROWS * t + r;
      for (int64_t i = 0; i < m; ++i) y[i * ldy + n] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        float d, dmin;
        x16_row(w + (t * nb + b) * X16_TILE_BYTES, r, d, dmin, sc, mn, v);
        for (int64_t i = 0; i < m; ++i) y[i * ldy + n] += q4k_block_dot(v, sc, mn, d, dmin, xq, i, b, k);
      }
    }
}

// The scalar path over Q5_K / IQ4_XS / Q3_K / Q2_K tiles t0..t1: the vnni kernels' integer sums.
void scalar_new_tiles(int fmt, const uint8_t* w, int64_t t0, int64_t t1, int64_t k, const QuantizedX& xq,
                      int64_t m, float* y, int64_t ldy) {
  const int64_t nb = k / QK_K, tb = tile_bytes(fmt);
  KFields f;
  for (int64_t t = t0; t < t1; ++t)
    for (int r = 0; r < X16_ROWS; ++r) {
      const int64_t n = X16_ROWS * t + r;
      for (int64_t i = 0; i < m; ++i) y[i * ldy + n] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        read_tile_row(fmt, w + (t * nb + b) * tb, r, f);
        for (int64_t i = 0; i < m; ++i) y[i * ldy + n] += fields_block_dot(fmt, f, xq, i, b, k);
      }
    }
}

// The scalar path over 32-value tiles t0..t1 (Q8_0, Q5_0, IQ4_NL, Q5_1): per block d dx dot(q_w, q_x)
// (+ m dx sum(q_x) for Q5_1), the vnni path's terms.
void scalar_q8x_tiles(int fmt, const uint8_t* w, int64_t t0, int64_t t1, int64_t k, const QuantizedX32& xq,
                      int64_t m, float* y, int64_t ldy) {
  const int64_t nb = k / Q8X_BLOCK, vb = q32_values_bytes(fmt), sb = q32_scale_bytes(fmt);
  const int32_t off = q32_offset(fmt);
  const bool mins = fmt == FMT_Q5_1_X16;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * nb * (X16_ROWS * q32_row_bytes(fmt));
    for (int r = 0; r < X16_ROWS; ++r) {
      const int64_t n = X16_ROWS * t + r;
      for (int64_t i = 0; i < m; ++i) y[i * ldy + n] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qs = tile + vb * b;
        const float d = fp16_to_fp32(tile + vb * nb + sb * b + 2 * r);
        const float mn = mins ? fp16_to_fp32(tile + vb * nb + sb * b + 32 + 2 * r) : 0.0f;
        for (int64_t i = 0; i < m; ++i) {
          const int8_t* q = xq.q.data() + i * k + b * Q8X_BLOCK;
          int32_t dot = 0, sum = 0;
          for (int g = 0; g < 8; ++g)
            for (int l = 0; l < 4; ++l) {
              dot += (q32_value(fmt, qs, r, g, l) - off) * q[4 * g + l];
              sum += q[4 * g + l];
            }
          const float dx = xq.d[i * nb + b];
          y[i * ldy + n] += (float)dot * (d * dx);
          if (mins) y[i * ldy + n] += (float)sum * (mn * dx);
        }
      }
    }
  }
}

// ------------------------------------------------------------------ vnni path

#if KI_QK_X86

// Weight super-block unpacked for the dot products: 4 x 64 u8 values in k order, each 4-value lane's
// sub-block scale as an int16 in the low half of its int32 lane (vpdpwssd's operand: dot * scale, the
// dots fitting int16), and `scv`: Q4_K's 8 scales then its 8 mins (int32 lanes), Q6_K's 16 scales.
struct Unpacked {
  __m512i v[4];
  __m512i s[4];
  __m512i scv;
  float d, dmin;
};

KI_VNNI inline void unpack_q4k(const uint8_t* blk, Unpacked& u) {
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t*)blk));  // d, dmin
  u.d = _mm_cvtss_f32(dd);
  u.dmin = _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 1));
  // ggml's get_scale_min_k4 on whole words (as its AVX2 q4_K dot does): bytes 0-7 scales, 8-15 mins
  uint32_t ut[4];
  std::memcpy(ut, blk + 4, 12);
  constexpr uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  ut[3] = ((ut[2] >> 4) & m4) | (((ut[1] >> 6) & m2) << 4);
  const uint32_t mins03 = ut[1] & m6;
  ut[1] = (ut[2] & m4) | (((ut[0] >> 6) & m2) << 4);
  ut[2] = mins03;
  ut[0] &= m6;
  u.scv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)ut));
  const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);  // upper 32 bytes: the high nibbles
  const __m512i lo4 = _mm512_set1_epi8(15);
  const uint8_t* qs = blk + 16;
  for (int c = 0; c < 4; ++c) {
    // qs[32c..32c+31] twice: low nibbles are k = 64c + l, high nibbles 64c + 32 + l
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * c)));
    u.v[c] = _mm512_and_si512(_mm512_srlv_epi64(both, shift), lo4);
    const int a = 2 * c, b = 2 * c + 1;
    u.s[c] = _mm512_permutexvar_epi32(_mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a), u.scv);
  }
}

KI_VNNI inline void unpack_q6k(const uint8_t* blk, Unpacked& u) {
  u.d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(*(const uint16_t*)(blk + 208))));
  u.dmin = 0.0f;
  u.scv = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192)));  // signed
  const __m512i sc16 = _mm512_and_si512(u.scv, _mm512_set1_epi32(0xffff));      // int16 in the low half
  const __m512i lo4 = _mm512_set1_epi8(15), lo2 = _mm512_set1_epi8(3);
  const __m512i sh_lo = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0), sh_hi = _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4);
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512((const void*)(blk + 64 * h));  // bytes l < 32: ql[l], else ql[32 + l]
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h)));
    const __m512i hl = _mm512_and_si512(_mm512_srlv_epi64(qh, sh_lo), lo2);
    const __m512i hh = _mm512_and_si512(_mm512_srlv_epi64(qh, sh_hi), lo2);
    u.v[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, lo4), _mm512_slli_epi16(hl, 4));  // k 128h + 0..63
    u.v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4),
                                     _mm512_slli_epi16(hh, 4));  // k 128h + 64..127
    for (int p = 0; p < 2; ++p) {
      const int j = 8 * h + 4 * p;  // sub-blocks j..j+3, 4 lanes each
      const __m512i idx = _mm512_set_epi32(j + 3, j + 3, j + 3, j + 3, j + 2, j + 2, j + 2, j + 2, j + 1, j + 1,
                                           j + 1, j + 1, j, j, j, j);
      u.s[2 * h + p] = _mm512_permutexvar_epi32(idx, sc16);
    }
  }
}

KI_VNNI void vnni_rows(int fmt, const uint8_t* w, int64_t n0, int64_t n1, int64_t k, const QuantizedX& xq,
                       int64_t m, float* y, int64_t ldy) {
  const int64_t nb = k / QK_K, bytes = fmt == FMT_Q4_K ? Q4_K_BYTES : Q6_K_BYTES;
  Unpacked u;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * bytes;
    for (int64_t r0 = 0; r0 < m; r0 += TILE_M) {
      const int mt = (int)std::min<int64_t>(TILE_M, m - r0);
      __m512 acc[TILE_M];
      for (int t = 0; t < mt; ++t) acc[t] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * bytes;
        if (fmt == FMT_Q4_K)
          unpack_q4k(blk, u);
        else
          unpack_q6k(blk, u);
        for (int t = 0; t < mt; ++t) {
          const int64_t r = r0 + t;
          const int8_t* q = xq.q.data() + r * k + b * QK_K;
          __m512i isum = _mm512_setzero_si512();
          for (int c = 0; c < 4; ++c) {
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.v[c],
                                                    _mm512_loadu_si512((const void*)(q + 64 * c)));
            isum = _mm512_dpwssd_epi32(isum, dot, u.s[c]);  // dot (|.| < 2^15) times its sub-block scale
          }
          const float dx = xq.d[r * nb + b];
          const __m512i sums = _mm512_loadu_si512((const void*)(xq.sums.data() + (r * nb + b) * 16));
          if (fmt == FMT_Q4_K) {  // lanes 8-15: m_j times sum_{k in j} q_x (lanes 0-7 of `sums` are 0)
            const __m512i mterm = _mm512_mullo_epi32(u.scv, sums);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(u.d * dx), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mterm), _mm512_set1_ps(u.dmin * dx), acc[t]);
          } else {  // minus 32 sc_j sum_{k in j} q_x
            isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_mullo_epi32(u.scv, sums), 5));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(u.d * dx), acc[t]);
          }
        }
      }
      for (int t = 0; t < mt; ++t) y[(r0 + t) * ldy + n] = _mm512_reduce_add_ps(acc[t]);
    }
  }
}
#endif  // KI_QK_X86
#endif  // !KI_QK_KERNELS

// ------------------------------------------------------------------ tile kernels, once per ISA
//
// This section is compiled twice (the file includes itself below): for the vnni path under AVX-512 target
// options with S = Avx512, for the avx2 path under AVX2 ones with S = Avx2 (the shims, further down). A
// tile's 64-byte vector holds value (r, k) at byte 4r + i, so rows 0-7 lie in its low 32 bytes and rows
// 8-15 in its high ones: Avx2 runs each kernel body once per half (S::HALVES), on 8 rows at a time, the
// loads offset by the half, and every op stays within a half. The integer sums are the same on both
// ISAs, the fp32 ops too, so the two paths agree bit for bit.
#if defined(KI_QK_KERNELS)

// The bytes a pass over a tile will read PF_AHEAD_BYTES further on, fetched into L1 now. The first pass
// over a tile streams it from memory and the hardware prefetcher fell behind there: Q4_K [16384, 3072] at
// M = 8 took 1.71 ms against 0.59 at M = 1 (49 GB/s) and 0.56 for a second pass of 8 rows from cache
// (2-core Zen 5): computing and fetching did not overlap. ~9 KB ahead is ~4 Q4_K super-blocks, ~300 ns of
// an 8-row pass: more than a miss takes. A later pass's prefetches hit L1 or L2 and cost an issue slot.
constexpr int64_t PF_AHEAD_BYTES = 9216;
constexpr int PF_MIN_ROWS = 2;
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(p + PF_AHEAD_BYTES + o), _MM_HINT_T0);
}
using I = S::I;
using F = S::F;
constexpr int H = S::HALVES;

// Q4_K x16 tiles t0..t1 (layout at the top): per sub-block j, eight u8 vectors (16 rows x 4 k, low then
// high nibbles) dotted with each x row's broadcast 4-byte groups; each lane's two 16-value dots (|.| <=
// 16 * 15 * 127 < 2^15) times its row's scale by `vpdpwssd`; the mins' term once per super-block as
// int16 pairs (m[2p], m[2p+1]) x (sum_2p, sum_2p+1); then per lane y += dx (d * isum - dmin * msum).
// The 16 lanes are 16 outputs: stored as they are, no horizontal sum. MT rows of x per pass over a tile's
// super-blocks, a compile-time count so that the per-row sums stay in registers.
// Q5_K (Q5 true): the same tile with each value's fifth bit from qh (bit g for the low nibble's vector g,
// 4 + g for the high one's) moved to bit 4; its 32-value dot (|.| <= 32 * 31 * 127 < 2^17) times the row's
// scale by `vpmulld`.
template <bool Q5, int MT>
void q4x_rows(const uint8_t* tiles, int64_t nb, int64_t k, const QuantizedX& xq, int64_t r0, float* y,
              int64_t ldy) {
  constexpr int64_t TB = Q5 ? Q5X_TILE_BYTES : X16_TILE_BYTES;
  const I lo4 = S::set8(15), b4 = S::set8(16);
  F acc[H][MT];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = S::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = tiles + b * TB;
    // Q5_K is prefetched from one row up, unlike the Q4_K / Q6_K / Q8_0 tiles (PF_MIN_ROWS): at one row the
    // hardware prefetcher alone left its loads uncovered, [16384, 2048] at M = 1 737 against 345 us (IQ4_XS
    // 404 / 342, Q3_K 315 / 283, Q2_K 244 / 227; Q4_K and Q6_K 0.9-1.04x: left as they were), same-process
    // alternated calls, 2-core Zen 5. Past the tile: the next tile.
    if constexpr (Q5 || MT >= PF_MIN_ROWS) prefetch_ahead(tile, TB);
    for (int hf = 0; hf < H; ++hf) {
      I isum[MT];
      for (int i = 0; i < MT; ++i) isum[i] = S::zero();
      for (int j = 0; j < 8; ++j) {
        const I sc = S::u8_i32(tile + X16_SC + 16 * j, hf);
        I lo[4], hi[4];
        for (int g = 0; g < 4; ++g) {
          const I v = S::load(tile + X16_QS + (4 * j + g) * 64, hf);
          lo[g] = S::and_(v, lo4);
          hi[g] = S::and_(S::srl16(v, 4), lo4);
        }
        if constexpr (Q5) {
          const I qh = S::load(tile + Q5X_QH + 64 * j, hf);
          const I hl[4] = {S::sll16(qh, 4), S::sll16(qh, 3), S::sll16(qh, 2), S::sll16(qh, 1)};
          const I hh[4] = {qh, S::srl16(qh, 1), S::srl16(qh, 2), S::srl16(qh, 3)};
          for (int g = 0; g < 4; ++g) {
            lo[g] = S::or_and(lo[g], hl[g], b4);
            hi[g] = S::or_and(hi[g], hh[g], b4);
          }
        }
        for (int i = 0; i < MT; ++i) {
          const int32_t* q = (const int32_t*)(xq.q.data() + (r0 + i) * k + b * QK_K + 32 * j);
          const I dl = S::template dot4<Q5 ? 31 : 15>(lo, q), dh = S::template dot4<Q5 ? 31 : 15>(hi, q + 4);
          if constexpr (Q5) {
            isum[i] = S::add32(isum[i], S::mul32(S::add32(dl, dh), sc));
          } else {
            isum[i] = S::dpwssd(S::dpwssd(isum[i], dl, sc), dh, sc);
          }
        }
      }
      const F d = S::f16(tile, hf), dmin = S::f16(tile + 32, hf);
      I mn[4];
      for (int p = 0; p < 4; ++p) mn[p] = S::u8_i16(tile + X16_MN + 32 * p, hf);
      for (int i = 0; i < MT; ++i) {
        const int64_t row = r0 + i;
        const int32_t* pr = xq.pairs.data() + (row * nb + b) * 4;
        I msum = S::zero();
        for (int p = 0; p < 4; ++p) msum = S::dpwssd_at(msum, mn[p], pr + p);
        const F dx = S::setf(xq.d[row * nb + b]);
        acc[hf][i] = S::fmadd(S::cvt(isum[i]), S::mul(d, dx), acc[hf][i]);
        acc[hf][i] = S::fnmadd(S::cvt(msum), S::mul(dmin, dx), acc[hf][i]);
      }
    }
  }
  for (int hf = 0; hf < H; ++hf)
    for (int i = 0; i < MT; ++i) S::store(y + (r0 + i) * ldy, hf, acc[hf][i]);
}

// Q6_K x16 tiles (layout at the top): per 32-value chunk J, eight u8 vectors of 6-bit values (16 rows x
// 4 k: the low nibbles with qh's bits for sub-block 2J, the high nibbles for 2J + 1), dotted with each x
// row's broadcast 4-byte groups; each sub-block's dot (|.| <= 16 * 63 * 127) times its row's scale by
// `vpmulld`; the -32 offset once per super-block as int16 pairs (sc[2p], sc[2p+1]) x (sum_2p, sum_2p+1);
// then per lane y += d dx (isum - 32 osum). The 16 lanes are 16 outputs; MT rows of x as in q4x_rows.
template <int MT>
void q6x_rows(const uint8_t* tiles, int64_t nb, int64_t k, const QuantizedX& xq, int64_t r0, float* y,
              int64_t ldy) {
  const I lo4 = S::set8(15), hi2 = S::set8(0x30);
  F acc[H][MT];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = S::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = tiles + b * Q6X_TILE_BYTES;
    if constexpr (MT >= PF_MIN_ROWS) prefetch_ahead(tile, Q6X_TILE_BYTES);
    for (int hf = 0; hf < H; ++hf) {
      I isum[MT];
      for (int i = 0; i < MT; ++i) isum[i] = S::zero();
      for (int J = 0; J < 8; ++J) {
        const I pv = S::s8_i16(tile + q6x_sc(J), hf);
        const I sa = S::sra32(S::sll32(pv, 16), 16), sb = S::sra32(pv, 16);
        const I h0 = S::load(tile + q6x_qh(J, 0), hf), h1 = S::load(tile + q6x_qh(J, 1), hf);
        // qh's bits 2g..2g+1 moved to bits 4..5 (16-bit shifts: the mask keeps each byte's own bits)
        const I s0[4] = {S::sll16(h0, 4), S::sll16(h0, 2), h0, S::srl16(h0, 2)};
        const I s1[4] = {S::sll16(h1, 4), S::sll16(h1, 2), h1, S::srl16(h1, 2)};
        I a[4], c[4];
        for (int g = 0; g < 4; ++g) {
          const I v = S::load(tile + q6x_ql(J, g), hf);
          a[g] = S::or_and(S::and_(v, lo4), s0[g], hi2);
          c[g] = S::or_and(S::and_(S::srl16(v, 4), lo4), s1[g], hi2);
        }
        for (int i = 0; i < MT; ++i) {
          const int32_t* q = (const int32_t*)(xq.q.data() + (r0 + i) * k + b * QK_K + 32 * J);
          const I da = S::template dot4<63>(a, q), dc = S::template dot4<63>(c, q + 4);
          isum[i] = S::add32(isum[i], S::add32(S::mul32(da, sa), S::mul32(dc, sb)));
        }
      }
      const F d = S::f16(tile, hf);
      I pv[8];
      for (int p = 0; p < 8; ++p) pv[p] = S::s8_i16(tile + q6x_sc(p), hf);
      for (int i = 0; i < MT; ++i) {
        const int64_t row = r0 + i;
        const int32_t* pr = xq.pairs.data() + (row * nb + b) * 8;
        I osum = S::zero();
        for (int p = 0; p < 8; ++p) osum = S::dpwssd_at(osum, pv[p], pr + p);
        const I tot = S::sub32(isum[i], S::sll32(osum, 5));
        acc[hf][i] = S::fmadd(S::cvt(tot), S::mul(d, S::setf(xq.d[row * nb + b])), acc[hf][i]);
      }
    }
  }
  for (int hf = 0; hf < H; ++hf)
    for (int i = 0; i < MT; ++i) S::store(y + (r0 + i) * ldy, hf, acc[hf][i]);
}

// IQ4_XS x16 tiles: each nibble looked up (vpshufb) as its level + 128 in u8, dotted as Q4_K's nibbles;
// a 32-value dot (|.| <= 32 * 241 * 127 < 2^20) times its row's signed scale by `vpmulld`; the + 128 taken
// off once per super-block as int16 pairs (s[2p], s[2p+1]) x (sum_2p, sum_2p+1) of 32 values, exact:
// y += d dx (isum - 128 osum). Where S's biased dot leaves the + 128 out (Avx2's: u8 x s8 pairs of the
// level + 128 would saturate int16) there is nothing to take off.
template <int MT>
void iq4x_rows(const uint8_t* tiles, int64_t nb, int64_t k, const QuantizedX& xq, int64_t r0, float* y,
               int64_t ldy) {
  alignas(16) uint8_t levels[16];
  for (int c = 0; c < 16; ++c) levels[c] = (uint8_t)(IQ4_VALUES[c] + 128);
  const I tbl = S::table16(levels), lo4 = S::set8(15);
  F acc[H][MT];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = S::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = tiles + b * IQ4X_TILE_BYTES;
    prefetch_ahead(tile, IQ4X_TILE_BYTES);  // from one row up: see q4x_rows
    for (int hf = 0; hf < H; ++hf) {
      I isum[MT];
      for (int i = 0; i < MT; ++i) isum[i] = S::zero();
      I sp[4];  // (s[2p], s[2p + 1]) of each row as int16 pairs
      for (int p = 0; p < 4; ++p) sp[p] = S::s8_i16(tile + IQ4X_S + 32 * p, hf);
      for (int j = 0; j < 8; ++j) {
        const I s = (j & 1) ? S::sra32(sp[j / 2], 16) : S::sra32(S::sll32(sp[j / 2], 16), 16);
        typename S::Biased lo[4], hi[4];
        for (int g = 0; g < 4; ++g) {
          const I v = S::load(tile + IQ4X_QS + (4 * j + g) * 64, hf);
          lo[g] = S::biased(S::shuffle8(tbl, S::and_(v, lo4)));
          hi[g] = S::biased(S::shuffle8(tbl, S::and_(S::srl16(v, 4), lo4)));
        }
        for (int i = 0; i < MT; ++i) {
          const int32_t* q = (const int32_t*)(xq.q.data() + (r0 + i) * k + b * QK_K + 32 * j);
          I dl = S::zero(), dh = S::zero();
          for (int g = 0; g < 4; ++g) {
            dl = S::dpbusd_biased_at(dl, lo[g], q + g);
            dh = S::dpbusd_biased_at(dh, hi[g], q + 4 + g);
          }
          isum[i] = S::add32(isum[i], S::mul32(S::add32(dl, dh), s));
        }
      }
      const F d = S::f16(tile, hf);
      for (int i = 0; i < MT; ++i) {
        const int64_t row = r0 + i;
        I tot = isum[i];
        if constexpr (S::BIASED_DOT_HAS_OFFSET) {
          const int32_t* pr = xq.pairs.data() + (row * nb + b) * 4;
          I osum = S::zero();
          for (int p = 0; p < 4; ++p) osum = S::dpwssd_at(osum, sp[p], pr + p);
          tot = S::sub32(tot, S::sll32(osum, 7));
        }
        acc[hf][i] = S::fmadd(S::cvt(tot), S::mul(d, S::setf(xq.d[row * nb + b])), acc[hf][i]);
      }
    }
  }
  for (int hf = 0; hf < H; ++hf)
    for (int i = 0; i < MT; ++i) S::store(y + (r0 + i) * ldy, hf, acc[hf][i]);
}

// Q3_K (Q3 true) or Q2_K x16 tiles: per 32-value chunk J one run (scales, two vectors of 2-bit values,
// Q3_K's high bits), unpacked to u8 values (Q3_K 0..7, the low 2 bits with the high bit at bit 2; Q2_K
// 0..3); a 16-value dot (|.| <= 16 * 7 * 127 < 2^15) times its row's scale by `vpdpwssd` (the scale in
// the low half of its lane, the high half zero); then Q3_K: y += d dx (isum - 4 osum), the -4 offset over
// int16 pairs (s[2p], s[2p+1]) x (sum_2p, sum_2p+1) of 16 values; Q2_K: y += dx (d isum - dmin msum), its
// 4-bit mins over the same pairs.
template <bool Q3, int MT>
void k2x_rows(const uint8_t* tiles, int64_t nb, int64_t k, const QuantizedX& xq, int64_t r0, float* y,
              int64_t ldy) {
  constexpr int64_t TB = Q3 ? Q3X_TILE_BYTES : Q2X_TILE_BYTES;
  constexpr int BASE = Q3 ? Q3X_BASE : Q2X_BASE, RUN = Q3 ? Q3X_RUN : Q2X_RUN;
  const I m3 = S::set8(3), b2 = S::set8(4);
  const I lo16 = S::set32(0xFFFF), nib = S::set32(0x0F), nib16 = S::set16(0x0F);
  F acc[H][MT];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = S::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = tiles + b * TB;
    prefetch_ahead(tile, TB);  // from one row up: see q4x_rows
    for (int hf = 0; hf < H; ++hf) {
      I isum[MT];
      for (int i = 0; i < MT; ++i) isum[i] = S::zero();
      for (int J = 0; J < 8; ++J) {
        const uint8_t* run = tile + BASE + RUN * J;
        I sa, sb;  // the scales of sub-blocks 2J and 2J + 1 in the low half of each row's lane
        if constexpr (Q3) {
          const I pv = S::s8_i16(run, hf);
          sa = S::and_(pv, lo16);
          sb = S::srl32(pv, 16);
        } else {
          const I pv = S::u8_i16(run, hf);
          sa = S::and_(pv, nib);
          sb = S::and_(S::srl32(pv, 16), nib);
        }
        const I l0 = S::load(run + 32, hf), l1 = S::load(run + 96, hf);
        I a[4], c[4];
        for (int g = 0; g < 4; ++g) {
          a[g] = S::and_(S::srl16(l0, 2 * g), m3);
          c[g] = S::and_(S::srl16(l1, 2 * g), m3);
        }
        if constexpr (Q3) {  // the high bits: bit g (low half's vector g), 4 + g (high half's), to bit 2
          const I hb = S::load(run + 160, hf);
          const I ha[4] = {S::sll16(hb, 2), S::sll16(hb, 1), hb, S::srl16(hb, 1)};
          for (int g = 0; g < 4; ++g) {
            a[g] = S::or_and(a[g], ha[g], b2);
            c[g] = S::or_and(c[g], S::srl16(hb, 2 + g), b2);
          }
        }
        for (int i = 0; i < MT; ++i) {
          const int32_t* q = (const int32_t*)(xq.q.data() + (r0 + i) * k + b * QK_K + 32 * J);
          const I da = S::template dot4<Q3 ? 7 : 3>(a, q), dc = S::template dot4<Q3 ? 7 : 3>(c, q + 4);
          isum[i] = S::dpwssd(S::dpwssd(isum[i], da, sa), dc, sb);
        }
      }
      const F d = S::f16(tile, hf);
      I pp[8];  // Q3_K: (s[2p], s[2p+1]); Q2_K: (m[2p], m[2p+1]), int16 pairs per row
      for (int p = 0; p < 8; ++p)
        pp[p] = Q3 ? S::s8_i16(tile + BASE + RUN * p, hf)
                   : S::and_(S::srl16(S::u8_i16(tile + BASE + RUN * p, hf), 4), nib16);
      for (int i = 0; i < MT; ++i) {
        const int64_t row = r0 + i;
        const int32_t* pr = xq.pairs.data() + (row * nb + b) * 8;
        I osum = S::zero();
        for (int p = 0; p < 8; ++p) osum = S::dpwssd_at(osum, pp[p], pr + p);
        const F dx = S::setf(xq.d[row * nb + b]);
        if constexpr (Q3) {
          const I tot = S::sub32(isum[i], S::sll32(osum, 2));
          acc[hf][i] = S::fmadd(S::cvt(tot), S::mul(d, dx), acc[hf][i]);
        } else {
          const F dmin = S::f16(tile + 32, hf);
          acc[hf][i] = S::fmadd(S::cvt(isum[i]), S::mul(d, dx), acc[hf][i]);
          acc[hf][i] = S::fnmadd(S::cvt(osum), S::mul(dmin, dx), acc[hf][i]);
        }
      }
    }
  }
  for (int hf = 0; hf < H; ++hf)
    for (int i = 0; i < MT; ++i) S::store(y + (r0 + i) * ldy, hf, acc[hf][i]);
}

// Runs f(std::integral_constant<int, MT>) for the row count mt (1..TILE_M): the kernels' compile-time MT.
template <typename Fn>
inline void with_rows(int mt, Fn&& f) {
  switch (mt) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Tiles t0..t1 of a 256-value tile format (Q4_K, Q6_K, Q5_K, IQ4_XS, Q3_K, Q2_K x16), all M rows of x:
// TILE_M rows per pass over a tile (a tile's bytes come from memory once, then from L1 for the next pass).
void tiles_rows(int fmt, const uint8_t* w, int64_t t0, int64_t t1, int64_t k, const QuantizedX& xq, int64_t m,
                float* y, int64_t ldy) {
  const int64_t nb = k / QK_K, tb = tile_bytes(fmt);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tiles = w + t * nb * tb;
    float* yt = y + X16_ROWS * t;
    for (int64_t r0 = 0; r0 < m; r0 += TILE_M) {
      with_rows((int)std::min<int64_t>(TILE_M, m - r0), [&](auto mt) {
        constexpr int MT = decltype(mt)::value;
        switch (fmt) {
          case FMT_Q4_K_X16: q4x_rows<false, MT>(tiles, nb, k, xq, r0, yt, ldy); break;
          case FMT_Q5_K_X16: q4x_rows<true, MT>(tiles, nb, k, xq, r0, yt, ldy); break;
          case FMT_Q6_K_X16: q6x_rows<MT>(tiles, nb, k, xq, r0, yt, ldy); break;
          case FMT_IQ4_XS_X16: iq4x_rows<MT>(tiles, nb, k, xq, r0, yt, ldy); break;
          case FMT_Q3_K_X16: k2x_rows<true, MT>(tiles, nb, k, xq, r0, yt, ldy); break;
          default: k2x_rows<false, MT>(tiles, nb, k, xq, r0, yt, ldy); break;
        }
      });
    }
  }
}

// Rows r0..r0+MT of x against one 32-value tile (16 output columns) of format FMT: per block eight
// vpdpbusd of the values with a broadcast dword of x, times d dx in fp32. Up to 4 rows, two int32
// accumulators per row (even and odd g) halve each dependency chain; with more rows there are chains
// enough (measured on a 2-core Zen 5: one or two accumulators alike at 16-64 rows, 8 chains alone too few).
//   Q8_0: the values held + 128 (S's biased dot; where it counts the + 128, 128 sum(q_x) comes off).
//   IQ4_NL: each of the four nibble vectors gives two of the eight as indices, looked up (vpshufb) to the
//     level + 128, then as Q8_0's (iq4x_rows' lookup).
//   Q5_0, Q5_1: each of the four nibble vectors gives two of the eight, 16 added where qh's bit is set; the
//     values (0..31) take the plain dot; Q5_0's 16 sum(q_x) comes off on every ISA, Q5_1's min adds
//     m dx sum(q_x) per block.
template <int FMT, int MT>
void q8x_rows(const uint8_t* tile, int64_t nb, int64_t k, const QuantizedX32& xq, int64_t r0, float* y,
              int64_t ldy) {
  constexpr bool Q5 = q32_has_qh(FMT), NL = FMT == FMT_IQ4_NL_X16, MINS = FMT == FMT_Q5_1_X16;
  constexpr int64_t VB = q32_values_bytes(FMT), SB = q32_scale_bytes(FMT);
  alignas(16) uint8_t levels[16];
  for (int c = 0; c < 16; ++c) levels[c] = (uint8_t)(IQ4_VALUES[c] + 128);
  const I lo4 = S::set8(15), sixteen = S::set8(16), tbl = S::table16(levels);
  F acc[H][MT];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = S::fzero();
  const uint8_t* dp = tile + VB * nb;
  const int64_t rb = r0 / TILE_M;
  const int32_t* xi = xq.xi.data() + rb * nb * 8 * TILE_M;
  const int32_t* st = xq.st.data() + rb * nb * TILE_M;
  const float* dt = xq.dt.data() + rb * nb * TILE_M;
  for (int64_t b = 0; b < nb; ++b, xi += 8 * TILE_M, st += TILE_M, dt += TILE_M) {
    const uint8_t* qs = tile + VB * b;
    if constexpr (MT >= PF_MIN_ROWS) {  // the values; the scales as far ahead in their own stream
      prefetch_ahead(qs, VB);
      _mm_prefetch((const char*)(dp + SB * (b + PF_AHEAD_BYTES / 512)), _MM_HINT_T0);
    }
    for (int hf = 0; hf < H; ++hf) {
      I s0[MT], s1[MT];
      for (int i = 0; i < MT; ++i) s0[i] = s1[i] = S::zero();
      for (int g = 0; g < 8; ++g) {
        if constexpr (Q5) {
          const I nibv = S::load(qs + 64 * (g & 3), hf);
          const I wv = S::add8_where(S::and_(g < 4 ? nibv : S::srl16(nibv, 4), lo4), qs + 256 + 8 * g, hf, sixteen);
          for (int i = 0; i < MT; ++i) {
            const int32_t* xv = xi + g * TILE_M + i;
            if ((g & 1) && MT <= 4)
              s1[i] = S::dpbusd_at(s1[i], wv, xv);
            else
              s0[i] = S::dpbusd_at(s0[i], wv, xv);
          }
        } else {
          typename S::Biased wv;
          if constexpr (NL) {
            const I nibv = S::load(qs + 64 * (g & 3), hf);
            wv = S::biased(S::shuffle8(tbl, S::and_(g < 4 ? nibv : S::srl16(nibv, 4), lo4)));
          } else {
            wv = S::biased(S::load(qs + 64 * g, hf));
          }
          for (int i = 0; i < MT; ++i) {
            const int32_t* xv = xi + g * TILE_M + i;
            if ((g & 1) && MT <= 4)
              s1[i] = S::dpbusd_biased_at(s1[i], wv, xv);
            else
              s0[i] = S::dpbusd_biased_at(s0[i], wv, xv);
          }
        }
      }
      const F d = S::f16(dp + SB * b, hf);
      for (int i = 0; i < MT; ++i) {
        I tot = S::add32(s0[i], s1[i]);
        if constexpr (FMT == FMT_Q5_0_X16 || (!Q5 && S::BIASED_DOT_HAS_OFFSET)) tot = S::sub32(tot, S::set32(st[i]));
        const F dx = S::setf(dt[i]);
        acc[hf][i] = S::fmadd(S::cvt(tot), S::mul(d, dx), acc[hf][i]);
        if constexpr (MINS) acc[hf][i] = S::fmadd(S::setf((float)st[i]), S::mul(S::f16(dp + SB * b + 32, hf), dx), acc[hf][i]);
      }
    }
  }
  for (int hf = 0; hf < H; ++hf)
    for (int i = 0; i < MT; ++i) S::store(y + (r0 + i) * ldy, hf, acc[hf][i]);
}

// 32-value tiles t0..t1 of format FMT, all M rows of x, TILE_M rows per pass over a tile (as tiles_rows).
template <int FMT>
void q8x_tiles(const uint8_t* w, int64_t t0, int64_t t1, int64_t k, const QuantizedX32& xq, int64_t m, float* y,
               int64_t ldy) {
  const int64_t nb = k / Q8X_BLOCK;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * nb * (X16_ROWS * q32_row_bytes(FMT));
    float* yt = y + X16_ROWS * t;
    for (int64_t r0 = 0; r0 < m; r0 += TILE_M)
      with_rows((int)std::min<int64_t>(TILE_M, m - r0),
                [&](auto mt) { q8x_rows<FMT, decltype(mt)::value>(tile, nb, k, xq, r0, yt, ldy); });
  }
}

// q8x_tiles of the 32-value tile format `fmt` (q32_format).
void q32_tiles(int fmt, const uint8_t* w, int64_t t0, int64_t t1, int64_t k, const QuantizedX32& xq, int64_t m,
               float* y, int64_t ldy) {
  switch (fmt) {
    case FMT_Q5_0_X16: q8x_tiles<FMT_Q5_0_X16>(w, t0, t1, k, xq, m, y, ldy); break;
    case FMT_IQ4_NL_X16: q8x_tiles<FMT_IQ4_NL_X16>(w, t0, t1, k, xq, m, y, ldy); break;
    case FMT_Q5_1_X16: q8x_tiles<FMT_Q5_1_X16>(w, t0, t1, k, xq, m, y, ldy); break;
    default: q8x_tiles<FMT_Q8_0_X16>(w, t0, t1, k, xq, m, y, ldy); break;
  }
}

#endif  // KI_QK_KERNELS

#if !defined(KI_QK_KERNELS)
#if KI_QK_X86
// ------------------------------------------------------------------ the tile kernels' two ISAs
//
// What the kernels above need of a vector of 16 (Avx512) or 8 (Avx2: one half of a tile vector, HALVES 2)
// int32 / fp32 lanes, one lane per weight row. The loads take a tile field's address and the half `h`:
//   load     64-byte vector, value (r, k) at byte 4r + i: bytes 32h.. on Avx2
//   u8_i32   16 bytes, one per row -> int32 lanes
//   u8_i16, s8_i16   32 bytes, two per row -> int16 pairs (one pair per int32 lane)
//   f16      16 fp16, one per row -> fp32 lanes
// dpbusd_at(acc, u8 w, q) is VNNI's dpbusd with x's s8 dword at q broadcast: acc + per lane the sum of four
// u8 x s8 products (dpwssd_at likewise for int16 pairs). Avx2 forms it as
// llama.cpp's AVX2 dot products do, maddubs (u8 x s8 pairs summed to int16, saturating) then madd by ones;
// exact where |w0 x0 + w1 x1| < 2^15, so for w <= 127 (|x| <= 127): every k-quant's code and Q5_0's. Values
// held + 128 (IQ4_XS's levels, Q8_0's q) go through `biased` / `dpbusd_biased_at`: Avx512 dots the u8 as
// stored (the kernel takes 128 sum(x) off: BIASED_DOT_HAS_OFFSET), Avx2 the signed value (w ^ 0x80) as
// |w| times x with w's sign, each pair within 2 * 128 * 127 < 2^15, and nothing to take off.

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
struct Avx512 {
  using I = __m512i;
  using F = __m512;
  using Biased = __m512i;
  static constexpr int HALVES = 1;
  static constexpr bool BIASED_DOT_HAS_OFFSET = true;
  static I zero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I set8(int v) { return _mm512_set1_epi8((char)v); }
  static I set16(int v) { return _mm512_set1_epi16((short)v); }
  static I set32(int32_t v) { return _mm512_set1_epi32(v); }
  static F setf(float v) { return _mm512_set1_ps(v); }
  static I load(const uint8_t* p, int) { return _mm512_loadu_si512((const void*)p); }
  static I u8_i32(const uint8_t* p, int) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I u8_i16(const uint8_t* p, int) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
  static I s8_i16(const uint8_t* p, int) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
  static F f16(const uint8_t* p, int) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static void store(float* y, int, F v) { _mm512_storeu_ps(y, v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_and(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }  // a | (b & c)
  static I srl16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I srl32(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I sll32(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I sra32(I a, int n) { return _mm512_srai_epi32(a, n); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I dpwssd(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  // dpbusd / dpwssd with the dword at q broadcast as the instruction's own {1to16} memory operand. GCC 12
  // does not fold _mm512_set1_epi32(*q) into it: it emits a vpbroadcastd for each, and here each feeds one
  // product, so the kernels spent an extra op per product (the tiles 1.02-1.25x slower a call on a 2-core
  // Zen 4; docs/benchmarks-log.md, "Broadcast operands folded into the VNNI products").
  static I dpbusd_at(I acc, I w, const int32_t* q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*q));
    return acc;
  }
  static I dpwssd_at(I acc, I a, const int32_t* q) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*q));
    return acc;
  }
  static Biased biased(I w) { return w; }
  static I dpbusd_biased_at(I acc, Biased w, const int32_t* q) { return dpbusd_at(acc, w, q); }
  // sum over g of dpbusd(w[g], x's dword q[g] broadcast); WMAX (the largest w) only matters to Avx2
  template <int WMAX>
  static I dot4(const I* w, const int32_t* q) {
    I acc = dpbusd_at(_mm512_setzero_si512(), w[0], q);
    for (int g = 1; g < 4; ++g) acc = dpbusd_at(acc, w[g], q + g);
    return acc;
  }
  static I table16(const uint8_t* t) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)t)); }
  static I shuffle8(I tbl, I idx) { return _mm512_shuffle_epi8(tbl, idx); }
  // a + b in the bytes whose bit is set in the 64-bit little-endian mask at `bits`
  static I add8_where(I a, const uint8_t* bits, int, I b) {
    uint64_t m;
    std::memcpy(&m, bits, 8);
    return _mm512_mask_add_epi8(a, _cvtu64_mask64(m), a, b);
  }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
};
namespace isa_vnni {
using S = Avx512;
#define KI_QK_KERNELS 1
#include "qk_native.cpp"
#undef KI_QK_KERNELS
}  // namespace isa_vnni
#pragma GCC pop_options

// Under -march=native on an AVX-512 CPU this region keeps the file's AVX-512 options (a target pragma adds,
// it does not take away), so the compiler may encode its AVX2 ops in EVEX form: that build only runs on
// that CPU. The x86-64-v3 build and one with the AVX-512 features disabled (KUBEINFER_CPU_DISABLE) hold
// AVX2 code only.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
struct Avx2 {
  using I = __m256i;
  using F = __m256;
  struct Biased {
    __m256i mag, sgn;  // |w - 128| as u8, w - 128 (its sign)
  };
  static constexpr int HALVES = 2;
  static constexpr bool BIASED_DOT_HAS_OFFSET = false;
  static I zero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I set8(int v) { return _mm256_set1_epi8((char)v); }
  static I set16(int v) { return _mm256_set1_epi16((short)v); }
  static I set32(int32_t v) { return _mm256_set1_epi32(v); }
  static F setf(float v) { return _mm256_set1_ps(v); }
  static I load(const uint8_t* p, int h) { return _mm256_loadu_si256((const __m256i*)(p + 32 * h)); }
  static I u8_i32(const uint8_t* p, int h) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h))); }
  static I u8_i16(const uint8_t* p, int h) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 * h))); }
  static I s8_i16(const uint8_t* p, int h) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 * h))); }
  static F f16(const uint8_t* p, int h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h))); }
  static void store(float* y, int h, F v) { _mm256_storeu_ps(y + 8 * h, v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_and(I a, I b, I c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }
  static I srl16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I sll16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I srl32(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I sll32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I sra32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I pairs(I p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }  // int16 pairs -> int32
  static I dpbusd(I acc, I w, I x) { return _mm256_add_epi32(acc, pairs(_mm256_maddubs_epi16(w, x))); }
  static I dpwssd(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  static I dpbusd_at(I acc, I w, const int32_t* q) { return dpbusd(acc, w, set32(*q)); }
  static I dpwssd_at(I acc, I a, const int32_t* q) { return dpwssd(acc, a, set32(*q)); }
  static Biased biased(I w) {
    const __m256i s = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return {_mm256_abs_epi8(s), s};
  }
  static I dpbusd_biased(I acc, const Biased& w, I x) {
    return _mm256_add_epi32(acc, pairs(_mm256_maddubs_epi16(w.mag, _mm256_sign_epi8(x, w.sgn))));
  }
  static I dpbusd_biased_at(I acc, const Biased& w, const int32_t* q) { return dpbusd_biased(acc, w, set32(*q)); }
  // maddubs's int16 pair sums (|.| <= 2 WMAX 127) added in int16 while they cannot overflow: all four
  // for WMAX <= 32 (Q4_K, Q5_K, Q3_K, Q2_K), two and two for Q6_K's 63; one madd per int16 sum.
  template <int WMAX>
  static I dot4(const I* w, const int32_t* q) {
    __m256i p[4];
    for (int g = 0; g < 4; ++g) p[g] = _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(q[g]));
    if constexpr (4 * 2 * WMAX * 127 < 32768) {
      return pairs(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])));
    } else {
      static_assert(2 * 2 * WMAX * 127 < 32768, "maddubs pair sums would overflow int16");
      return _mm256_add_epi32(pairs(_mm256_add_epi16(p[0], p[1])), pairs(_mm256_add_epi16(p[2], p[3])));
    }
  }
  static I table16(const uint8_t* t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)t)); }
  static I shuffle8(I tbl, I idx) { return _mm256_shuffle_epi8(tbl, idx); }  // per 128-bit lane: tbl twice
  // bytes 4h..4h+3 of the mask: each byte j of the half picks mask byte j / 8, keeps bit j % 8
  static I add8_where(I a, const uint8_t* bits, int h, I b) {
    int32_t m;
    std::memcpy(&m, bits + 4 * h, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(m), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                               2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_add_epi8(a, _mm256_and_si256(set, b));
  }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
};
namespace isa_avx2 {
using S = Avx2;
#define KI_QK_KERNELS 1
#include "qk_native.cpp"
#undef KI_QK_KERNELS
}  // namespace isa_avx2
#pragma GCC pop_options
#endif  // KI_QK_X86

#if KI_QK_X86
// ------------------------------------------------------------------ amx path (bf16 layers, batches of rows)
//
// Where AMX-BF16 is usable and a layer computes in bf16 (w->compute KI_COMPUTE_BF16), batches of at least
// amx_min_rows rows of x over Q4_K / Q6_K x16 tiles run here instead of the int8 kernels above: each 16-column
// tile's super-blocks dequantized once per call to bf16 B tiles in a per-thread buffer ((d sc) q - dmin m,
// (d sc) (q - 32), each product rounded as dequant_row's, then rounded to bf16), x rounded to bf16 once per
// call, and `tdpbf16ps` on 16 x 32 x 16 tiles accumulating in fp32 over the whole K: no per-block rescale of
// integer sums (what sank an AMX-INT8 take on the int8 path, docs/benchmarks-log.md "AMX"). The result is
// round_bf16(x) @ round_bf16(W)^T up to fp32 summation order: the numerics of the dequantize + bf16 GEMM
// that the same layers take at 256 rows and more (server/quant/block_linear.py), not the int8 kernels'.
// B tile (Intel's VNNI layout for bf16 pairs): 16 rows of 64 bytes, row p holding for column r the pair
// (w[r][32c + 2p], w[r][32c + 2p + 1]) at bytes 4r..4r+3; a tile vector's byte 4r + i (value (r, k0 + i))
// gives rows k0 / 2 and k0 / 2 + 1. Rows of x pass 64 at a time (four C tiles), padded to 16 with zeros.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
namespace amx {

constexpr int64_t CHUNK = 32;       // k per tdpbf16ps (16 bf16 pairs)
constexpr int64_t B_BYTES = 1024;   // one B tile: 16 pairs x 16 columns x 4 bytes
constexpr int64_t GROUP_ROWS = 64;  // rows of x per pass over a column tile's B tiles: four C tiles
constexpr int64_t BLOCK_X_BYTES = 1 << 20;  // bf16 x per block of rows x K (kubeinfer_qk_linear_bf16): half an L2
constexpr int64_t BLOCK_K = 2048; // K per such block (a multiple of 256): 256 rows of it fill BLOCK_X_BYTES

struct alignas(64) TileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The compiler does not see tileloadd read memory (GCC's macro has no memory operand): stores it must
// finish before a tile load are fenced by this.
inline void compiler_fence() { __asm__ volatile("" ::: "memory"); }

// Two B tile rows (128 bytes at dst) from a tile vector v of codes (value (r, k0 + i) at byte 4r + i) and
// per-column fp32 scale s and offset o: w = s q - o (Q6 false, Q4_K) or s (q - 32) (Q6 true, Q6_K).
template <bool Q6>
inline void b_rows(__m512i v, __m512 s, __m512 o, uint8_t* dst) {
  // element 2r of the result = element r of the source, 2r + 1 = element 16 + r (cvtne2ps puts its second
  // operand's 16 values first)
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i ff = _mm512_set1_epi32(0xFF);
  __m512 w[4];
  for (int i = 0; i < 4; ++i) {
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), ff);
    if constexpr (Q6)
      w[i] = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32))));
    else  // s q is exact in fp32 (d: 11 significant bits, sc and q 6 and 4), so one rounding either way
      w[i] = _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(q), o);
  }
  const __m512i p01 = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
  const __m512i p23 = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]));
  _mm512_store_si512((void*)dst, p01);
  _mm512_store_si512((void*)(dst + 64), p23);
}

// One Q4_K x16 super-block (layout at the top) -> 8 B tiles at b (8 KB, 64-byte aligned), tile j = sub-block j.
inline void dequant_q4x(const uint8_t* tile, uint8_t* b) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)tile));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tile + 32)));
  const __m512i lo4 = _mm512_set1_epi8(15), low16 = _mm512_set1_epi32(0xFFFF);
  for (int j = 0; j < 8; ++j) {
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(tile + X16_SC + 16 * j)));
    const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    // mn[j / 2][r] = {m[2p][r], m[2p + 1][r]}: one int32 lane per column after widening the bytes to int16
    const __m512i mp = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(tile + X16_MN + 32 * (j / 2))));
    const __m512i mn = (j & 1) ? _mm512_srli_epi32(mp, 16) : _mm512_and_si512(mp, low16);
    const __m512 o = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
    uint8_t* bj = b + j * B_BYTES;
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512((const void*)(tile + X16_QS + (4 * j + g) * 64));
      b_rows<false>(_mm512_and_si512(v, lo4), s, o, bj + 128 * g);  // k = 32j + 4g + i
      b_rows<false>(_mm512_and_si512(_mm512_srli_epi16(v, 4), lo4), s, o, bj + 512 + 128 * g);  // + 16
    }
  }
}

// One Q6_K x16 super-block -> 8 B tiles at b, tile J = the 32-value chunk J (sub-blocks 2J and 2J + 1).
inline void dequant_q6x(const uint8_t* tile, uint8_t* b) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)tile));
  const __m512i lo4 = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
  for (int J = 0; J < 8; ++J) {
    const __m512i pv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(tile + q6x_sc(J))));
    const __m512 s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pv, 16), 16)));
    const __m512 s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(pv, 16)));
    const __m512i h0 = _mm512_loadu_si512((const void*)(tile + q6x_qh(J, 0)));
    const __m512i h1 = _mm512_loadu_si512((const void*)(tile + q6x_qh(J, 1)));
    // qh's bits 2g..2g+1 moved to bits 4..5 (16-bit shifts: the mask keeps each byte's own bits)
    const __m512i t0[4] = {_mm512_slli_epi16(h0, 4), _mm512_slli_epi16(h0, 2), h0, _mm512_srli_epi16(h0, 2)};
    const __m512i t1[4] = {_mm512_slli_epi16(h1, 4), _mm512_slli_epi16(h1, 2), h1, _mm512_srli_epi16(h1, 2)};
    uint8_t* bj = b + J * B_BYTES;
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512((const void*)(tile + q6x_ql(J, g)));
      const __m512i a = _mm512_or_si512(_mm512_and_si512(v, lo4), _mm512_and_si512(t0[g], hi2));
      const __m512i c =
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), lo4), _mm512_and_si512(t1[g], hi2));
      b_rows<true>(a, s0, s0, bj + 128 * g);
      b_rows<true>(c, s1, s1, bj + 512 + 128 * g);
    }
  }
}

inline void dequant(int fmt, const uint8_t* tile, uint8_t* b) {
  if (fmt == FMT_Q4_K_X16)
    dequant_q4x(tile, b);
  else
    dequant_q6x(tile, b);
}

// C tile i += A tiles (rows 16i.. of the group) x B tile tb, for the NC C tiles in use. Tile numbers are
// the instructions' immediates (GCC's macros spell them into the text), hence the macros.
#define KI_AMX_STEP(tb)                                         \
  do {                                                          \
    _tile_loadd(tb, bt, 64);                                    \
    _tile_loadd(4, a, lda);                                     \
    _tile_dpbf16ps(0, 4, tb);                                   \
    if constexpr (NC > 1) {                                     \
      _tile_loadd(5, a + 16 * k, lda);                          \
      _tile_dpbf16ps(1, 5, tb);                                 \
    }                                                           \
    if constexpr (NC > 2) {                                     \
      _tile_loadd(4, a + 32 * k, lda);                          \
      _tile_dpbf16ps(2, 4, tb);                                 \
    }                                                           \
    if constexpr (NC > 3) {                                     \
      _tile_loadd(5, a + 48 * k, lda);                          \
      _tile_dpbf16ps(3, 5, tb);                                 \
    }                                                           \
  } while (0)

// Rows r0..r0 + 16 NC of the bf16 x (xb [mp, k], mp a multiple of 16) against one column tile's B tiles
// (bufs: k / 32 of them in k order) into C tiles 0..NC-1, zeroed first.
template <int NC>
void group_tiles(int fmt, const uint8_t* src, int64_t tb, uint8_t* bufs, const uint16_t* xb, int64_t k,
                 int64_t kk, int64_t r0) {
  // xb: row stride k (elements); this pass covers its first kk columns (a multiple of 256)
  const int64_t lda = 2 * k;
  for (int64_t c = 0; c < kk / CHUNK; c += 2) {  // kk / 32 is even
    const uint8_t* b0 = bufs + c * B_BYTES;
    if (src) {  // super-block c / 8 into one of two 8 KB halves (k >= 512: bufs holds both), then read
      uint8_t* half = bufs + (c / 8 % 2) * 8 * B_BYTES;
      if (c % 8 == 0) {
        compiler_fence();  // after the tile loads that read this half two super-blocks ago
        dequant(fmt, src + c / 8 * tb, half);
        compiler_fence();
      }
      b0 = half + (c % 8) * B_BYTES;
    }
    {
      const uint8_t* bt = b0;
      const uint16_t* a = xb + r0 * k + c * CHUNK;
      KI_AMX_STEP(6);
    }
    {
      const uint8_t* bt = b0 + B_BYTES;
      const uint16_t* a = xb + r0 * k + (c + 1) * CHUNK;
      KI_AMX_STEP(7);
    }
  }
}
#undef KI_AMX_STEP

// C tile i's 16 x 16 fp32 -> rows row0.. of yt (those below m; row stride ldy floats).
#define KI_AMX_STORE(i)                                                                         \
  do {                                                                                          \
    const int64_t row0 = r0 + 16 * (i);                                                         \
    if (row0 + 16 <= m) {                                                                       \
      _tile_stored(i, yt + row0 * ldy, ldy * (int64_t)sizeof(float));                           \
    } else if (row0 < m) {                                                                      \
      _tile_stored(i, tmp, 64);                                                                 \
      for (int64_t r = row0; r < m; ++r) std::memcpy(yt + r * ldy, tmp + 16 * (r - row0), 64);  \
    }                                                                                           \
  } while (0)
// C tile i = 0, or (accumulate) yt's rows row0.. as KI_AMX_STORE wrote them, zeros past m.
#define KI_AMX_INIT(i)                                                                          \
  do {                                                                                          \
    const int64_t row0 = r0 + 16 * (i);                                                         \
    if (!accumulate) {                                                                          \
      _tile_zero(i);                                                                            \
    } else if (row0 + 16 <= m) {                                                                \
      _tile_loadd(i, yt + row0 * ldy, ldy * (int64_t)sizeof(float));                            \
    } else {                                                                                    \
      std::memset(tmp, 0, sizeof(tmp));                                                         \
      for (int64_t r = row0; r < m; ++r) std::memcpy(tmp + 16 * (r - row0), yt + r * ldy, 64);  \
      compiler_fence();                                                                         \
      _tile_loadd(i, tmp, 64);                                                                  \
    }                                                                                           \
  } while (0)

// y[m, 16 t0 .. 16 t1) (row stride ldy) = (accumulate: y +) xb[:m, :kk] @ W[:, k0 : k0 + kk]^T for column
// tiles t0..t1 of a Q4_K / Q6_K x16 weight [n, k]; xb's rows are k apart and start at column k0; bufs:
// this thread's kk * 32 bytes, 64-byte aligned.
void tiles_bf16(int fmt, const uint8_t* w, int64_t t0, int64_t t1, int64_t k, int64_t k0, int64_t kk,
                const uint16_t* xb, int64_t m, float* y, int64_t ldy, bool accumulate, uint8_t* bufs) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  compiler_fence();  // GCC's ldtilecfg names 8 bytes of its operand: the other stores must not be dropped
  _tile_loadconfig(&cfg);
  alignas(64) float tmp[16 * 16];
  const int64_t nb = k / QK_K, tb = tile_bytes(fmt);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tiles = w + (t * nb + k0 / QK_K) * tb;
    float* yt = y + X16_ROWS * t;
    if (m > GROUP_ROWS) {  // every super-block's B tiles first, then each group of rows over them
      compiler_fence();
      for (int64_t b = 0; b < kk / QK_K; ++b) dequant(fmt, tiles + b * tb, bufs + b * 8 * B_BYTES);
      compiler_fence();
    }
    for (int64_t r0 = 0; r0 < m; r0 += GROUP_ROWS) {
      const int64_t nc = std::min<int64_t>(4, (m - r0 + 15) / 16);
      const uint8_t* src = m > GROUP_ROWS ? nullptr : tiles;  // one group: dequantized as it goes
      KI_AMX_INIT(0);
      if (nc > 1) KI_AMX_INIT(1);
      if (nc > 2) KI_AMX_INIT(2);
      if (nc > 3) KI_AMX_INIT(3);
      switch (nc) {
        case 1: group_tiles<1>(fmt, src, tb, bufs, xb, k, kk, r0); break;
        case 2: group_tiles<2>(fmt, src, tb, bufs, xb, k, kk, r0); break;
        case 3: group_tiles<3>(fmt, src, tb, bufs, xb, k, kk, r0); break;
        default: group_tiles<4>(fmt, src, tb, bufs, xb, k, kk, r0); break;
      }
      KI_AMX_STORE(0);
      if (nc > 1) KI_AMX_STORE(1);
      if (nc > 2) KI_AMX_STORE(2);
      if (nc > 3) KI_AMX_STORE(3);
    }
  }
  _tile_release();
}
#undef KI_AMX_INIT
#undef KI_AMX_STORE

// x [m, k] fp32 (row stride ldx) -> xb [mp, k] bf16 (round to nearest even), rows m..mp zero.
void round_rows_bf16(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t mp, uint16_t* xb, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (m * k > (1 << 15))
  for (int64_t r = 0; r < mp; ++r) {
    uint16_t* o = xb + r * k;
    if (r >= m) {
      std::memset(o, 0, k * sizeof(uint16_t));
      continue;
    }
    const float* xr = x + r * ldx;
    for (int64_t i = 0; i < k; i += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i));
      _mm512_storeu_si512((void*)(o + i), (__m512i)v);
    }
  }
}

}  // namespace amx
#pragma GCC pop_options

// Whether this CPU has AMX-BF16 and Linux lets this process use the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, granted here if it was not yet).
bool amx_bf16_permitted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
#endif  // KI_QK_X86

// The fewest rows that take the amx path (0: off). Set at load, not thread-safe against running kernels.
int64_t amx_min_rows = 0;

// One row of W in fp32, gguf-py's dequantization bit for bit: (d * sc) * q - dmin * m (Q4_K),
// (d * sc) * (q - 32) (Q6_K), each product rounded (no FMA contraction: -ffp-contract=off).
void dequant_row(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, float* o) {
  if (q32_format(fmt)) {  // d * q (q less its offset) [+ m] as the references compute
    const int64_t nb = k / Q8X_BLOCK, vb = q32_values_bytes(fmt), sb = q32_scale_bytes(fmt);
    const int r = (int)(n % X16_ROWS);  // row n is row n % 16 of tile n / 16
    const uint8_t* tile = w + (n / X16_ROWS) * nb * (X16_ROWS * q32_row_bytes(fmt));
    for (int64_t b = 0; b < nb; ++b) {
      const float d = fp16_to_fp32(tile + vb * nb + sb * b + 2 * r);
      for (int g = 0; g < 8; ++g)
        for (int l = 0; l < 4; ++l) {
          float& v = o[b * Q8X_BLOCK + 4 * g + l];
          v = (float)(q32_value(fmt, tile + vb * b, r, g, l) - q32_offset(fmt)) * d;
          if (fmt == FMT_Q5_1_X16) v = v + fp16_to_fp32(tile + vb * nb + sb * b + 32 + 2 * r);
        }
    }
    return;
  }
  const int64_t nb = k / QK_K;
  const uint8_t* row = w + n * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    float* ob = o + b * QK_K;
    if (new_tiles(fmt)) {  // row n is row n % 16 of tile n / 16
      KFields f;
      read_tile_row(fmt, w + ((n / X16_ROWS) * nb + b) * tile_bytes(fmt), (int)(n % X16_ROWS), f);
      fields_dequant(fmt, f, ob);
    } else if (fmt == FMT_Q6_K_X16) {  // row n is row n % 16 of tile n / 16
      float d;
      int8_t sc[16];
      uint8_t v[QK_K];
      q6x_row(w + ((n / X16_ROWS) * nb + b) * Q6X_TILE_BYTES, (int)(n % X16_ROWS), d, sc, v);
      for (int i = 0; i < QK_K; ++i) ob[i] = (d * sc[i / 16]) * (float)((int)v[i] - 32);
    } else if (fmt == FMT_Q4_K_X16) {  // row n is row n % 16 of tile n / 16
      float d, dmin;
      uint8_t sc[8], mn[8], v[QK_K];
      x16_row(w + ((n / X16_ROWS) * nb + b) * X16_TILE_BYTES, (int)(n % X16_ROWS), d, dmin, sc, mn, v);
      for (int i = 0; i < QK_K; ++i) ob[i] = (d * sc[i / 32]) * (float)v[i] - dmin * mn[i / 32];
    } else if (fmt == FMT_Q4_K) {
      const uint8_t* blk = row + b * Q4_K_BYTES;
      const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
      uint8_t sc[8], mn[8];
      q4k_scales(blk + 4, sc, mn);
      uint8_t v[QK_K];
      q4k_values(blk, v);
      for (int i = 0; i < QK_K; ++i) ob[i] = (d * sc[i / 32]) * (float)v[i] - dmin * mn[i / 32];
    } else {
      const uint8_t* blk = row + b * Q6_K_BYTES;
      const int8_t* sc = (const int8_t*)(blk + 192);
      const float d = fp16_to_fp32(blk + 208);
      uint8_t v[QK_K];
      q6k_values(blk, v);
      for (int i = 0; i < QK_K; ++i) ob[i] = (d * sc[i / 16]) * (float)((int)v[i] - 32);
    }
  }
}

// fp32 activations (layers computing in fp32: the parity tests' --dtype float32): each weight row
// dequantized once into a buffer, then dotted with every row of x in 16 fp32 lanes (summed lane-wise,
// then across lanes: an fp32 order of its own, within fp32 rounding of the dequantized weight's product).
void fp32_rows(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t k, const float* x,
               int64_t m, int64_t ldx, float* y, int64_t ldy) {
  std::vector<float> buf(k);
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(fmt, w, row_bytes, n, k, buf.data());
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * ldx;
      float acc[16] = {0};
      for (int64_t i = 0; i < k; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += buf[i + j] * xr[i + j];
      float s = 0.0f;
      for (int j = 0; j < 16; ++j) s += acc[j];
      y[r * ldy + n] = s;
    }
  }
}

// f(i0, i1) on `nt` threads, each taking one contiguous span of [0, count) (possibly empty).
template <typename F>
void over_spans(int64_t count, int nt, F&& f) {
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t chunk = (count + nth - 1) / nth, i0 = std::min<int64_t>(count, t * chunk),
                  i1 = std::min<int64_t>(count, i0 + chunk);
    f(i0, i1);
  }
}

int best_compiled_path() {
#if KI_QK_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    return PATH_VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return PATH_AVX2;  // F16C: AVX2's CPUs
#endif
  return PATH_SCALAR;
}

}  // namespace

extern "C" {

int32_t kubeinfer_qk_native_abi() { return 10; }

// csrc/qlinear.cpp's descriptor, field for field. For these weights (bits KI_BITS_KQUANT = 6): q is the
// super-blocks, [n, row_bytes] with row_bytes = k / 256 * 144 (Q4_K) or 210 (Q6_K), group_size 256; or the
// 16-row tiles (group_size X16_GROUP), row_bytes k / 256 * 148 (Q4_K), 210 (Q6_K), 180 (Q5_K), 138 (IQ4_XS),
// 114 (Q3_K) or 84 (Q2_K); or the 32-value 16-row tiles (group_size Q8X_GROUP), row_bytes k / 32 * 34
// (Q8_0), 22 (Q5_0), 18 (IQ4_NL) or 24 (Q5_1); scales, mins unused.
struct KiQWeight {
  const uint8_t* q;
  const void* scales;
  const void* mins;
  int64_t n, k, group_size, groups, row_bytes;
  int32_t bits, zero_point, scale_is_f16;
  int32_t compute;
  const uint8_t* packed;
};

// The path to run: 2 vnni, 1 avx2 (the tiles only: row-major Q4_K / Q6_K run scalar there), 0 scalar;
// lowered to what this CPU reports. Returns the path now in use. Set at load, not thread-safe against
// running kernels.
int32_t kubeinfer_qk_set_path(int32_t path) {
  path_in_use = std::min(std::max(path, PATH_SCALAR), best_compiled_path());
  return path_in_use;
}

// y[m, n] (row stride ldy) = x[m, k] (row stride ldx, fp32) @ W^T, W [n, k] as `fmt` super-blocks (0 Q4_K,
// 1 Q6_K: rows of k / 256 blocks; 2 Q4_K x16, 3 Q6_K x16, 4 Q8_0 x16, 5 Q5_0 x16, 14 IQ4_NL x16, 15 Q5_1 x16
// (k a multiple of 32), 6 Q5_K x16, 7 IQ4_XS x16, 8 Q3_K x16, 9 Q2_K x16: tiles of 16 rows, n a multiple of
// 16). Returns 0, or 1 for bad
// arguments (Python checks them first).
int32_t kubeinfer_qk_linear(int32_t fmt, const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t m,
                            int64_t ldx, float* y, int64_t ldy, int32_t threads) {
  const bool q32 = q32_format(fmt);
  if (!w || !x || !y || n < 0 || m < 0 || k <= 0 || k % (q32 ? Q8X_BLOCK : QK_K)) return 1;
  if ((fmt < FMT_Q4_K || fmt > FMT_Q2_K_X16) && !q32) return 1;
  const bool tiled = fmt >= FMT_Q4_K_X16;
  if (tiled && n % X16_ROWS) return 1;
  if (m == 0 || n == 0) return 0;
  const int path = path_in_use;
  const bool vnni = path == PATH_VNNI;
  if (q32) {
    QuantizedX32 xq;
    quantize_rows32(fmt, x, m, ldx, k, xq, path, threads);
    const int64_t tiles = n / X16_ROWS;
    over_spans(tiles, std::max<int32_t>(1, std::min<int64_t>(threads, tiles)), [&](int64_t t0, int64_t t1) {
#if KI_QK_X86
      if (vnni)
        isa_vnni::q32_tiles(fmt, w, t0, t1, k, xq, m, y, ldy);
      else if (path == PATH_AVX2)
        isa_avx2::q32_tiles(fmt, w, t0, t1, k, xq, m, y, ldy);
      else
#endif
        scalar_q8x_tiles(fmt, w, t0, t1, k, xq, m, y, ldy);
    });
    return 0;
  }
  QuantizedX xq;
  quantize_rows(fmt, x, m, ldx, k, xq);
  if (tiled) {
    const int64_t tiles = n / X16_ROWS;
    over_spans(tiles, std::max<int32_t>(1, std::min<int64_t>(threads, tiles)), [&](int64_t t0, int64_t t1) {
#if KI_QK_X86
      if (vnni)
        isa_vnni::tiles_rows(fmt, w, t0, t1, k, xq, m, y, ldy);
      else if (path == PATH_AVX2)
        isa_avx2::tiles_rows(fmt, w, t0, t1, k, xq, m, y, ldy);
      else
#endif
          if (new_tiles(fmt))
        scalar_new_tiles(fmt, w, t0, t1, k, xq, m, y, ldy);
      else if (fmt == FMT_Q6_K_X16)
        scalar_q6x_tiles(w, t0, t1, k, xq, m, y, ldy);
      else
        scalar_x16_tiles(w, t0, t1, k, xq, m, y, ldy);
    });
    return 0;
  }
  const int nt = std::max<int32_t>(1, std::min<int64_t>(threads, n / 16 > 0 ? n / 16 : 1));
  over_spans(n, nt, [&](int64_t n0, int64_t n1) {
#if KI_QK_X86
    if (vnni)
      vnni_rows(fmt, w, n0, n1, k, xq, m, y, ldy);
    else
#endif
      scalar_rows(fmt, w, n0, n1, k, xq, m, y, ldy);
    (void)vnni;
  });
  return 0;
}

// The amx path (above) for batches of at least `min_rows` rows of bf16 layers over Q4_K / Q6_K x16 tiles; 0
// turns it off. Lowered to 0 where the CPU lacks AMX-BF16 or Linux refuses this process the tile data.
// Returns the value in use. Set at load, not thread-safe against running kernels.
int64_t kubeinfer_qk_set_amx(int64_t min_rows) {
#if KI_QK_X86
  amx_min_rows = min_rows > 0 && amx_bf16_permitted() ? min_rows : 0;
#else
  amx_min_rows = 0;
#endif
  return amx_min_rows;
}

// The fewest rows the amx path takes now (0: off): kubeinfer_qk_set_amx's last result.
int64_t kubeinfer_qk_amx_min_rows() { return amx_min_rows; }

// y[m, n] (row stride ldy) = round_bf16(x[m, k]) @ round_bf16(W)^T on the amx path, for any m, W [n, k] as
// fmt 2 (Q4_K x16) or 3 (Q6_K x16), n a multiple of 16, k of 256. Returns 0, 1 for bad arguments, 2 where
// the amx path is off (kubeinfer_qk_set_amx).
int32_t kubeinfer_qk_linear_bf16(int32_t fmt, const uint8_t* w, int64_t n, int64_t k, const float* x, int64_t m,
                                 int64_t ldx, float* y, int64_t ldy, int32_t threads) {
  if (!w || !x || !y || n < 0 || m < 0 || k <= 0 || k % QK_K || n % X16_ROWS) return 1;
  if (fmt != FMT_Q4_K_X16 && fmt != FMT_Q6_K_X16) return 1;
  if (amx_min_rows == 0) return 2;
  if (m == 0 || n == 0) return 0;
#if KI_QK_X86
  // thread_local: the decode graph calls from one thread, step after step; the buffers stay allocated
  static thread_local std::vector<uint16_t> xb;
  const int64_t mp = (m + 15) / 16 * 16, tiles = n / X16_ROWS;
  const int nt = std::max<int32_t>(1, std::min<int64_t>(threads, tiles));
  xb.resize(mp * k);
  amx::round_rows_bf16(x, m, ldx, k, mp, xb.data(), nt);
  amx::compiler_fence();
  const uint16_t* xp = xb.data();  // this thread's buffer: inside the lambda, `xb` names each worker's own
  // Blocks of rows x K whose bf16 x stays in L2 while every column tile passes over it (BLOCK_X_BYTES), the
  // C tiles carried across K blocks through y (where x does not fit whole): one block over all of x re-read
  // 8 MB per column tile at 2,048 rows and ran at 0.6-0.9x oneDNN's GEMM, 1.1-1.4x with the blocks.
  const int64_t kblock = mp * k * 2 <= amx::BLOCK_X_BYTES ? k : std::min<int64_t>(k, amx::BLOCK_K);
  const int64_t block = std::max<int64_t>(amx::GROUP_ROWS, amx::BLOCK_X_BYTES / (2 * kblock) / 64 * 64);
  for (int64_t r0 = 0; r0 < m; r0 += block) {
    const int64_t rows = std::min<int64_t>(block, m - r0);
    for (int64_t k0 = 0; k0 < k; k0 += kblock) {
      const int64_t kk = std::min<int64_t>(kblock, k - k0);
      over_spans(tiles, nt, [&](int64_t t0, int64_t t1) {
        static thread_local std::vector<uint8_t> raw;
        raw.resize(kk * 32 + 64);  // the column tile's kk / 32 B tiles of 1 KB, 64-byte aligned
        uint8_t* bufs = (uint8_t*)(((uintptr_t)raw.data() + 63) & ~(uintptr_t)63);
        if (t0 < t1)
          amx::tiles_bf16(fmt, w, t0, t1, k, k0, kk, xp + r0 * k + k0, rows, y + r0 * ldy, ldy, k0 > 0, bufs);
      });
    }
  }
  return 0;
#else
  return 2;
#endif
}

// GGUF rows of `fmt` (0 Q4_K, 1 Q6_K, 10 Q5_K, 11 IQ4_XS, 12 Q3_K, 13 Q2_K: [n, k / 256 * 144, 210, 176, 136,
// 110 or 84]) -> their 16-row tiles (148, 210, 180, 138, 114 or 84 bytes per row per 256; layouts at the top),
// n a multiple of 16. Returns 0, or 1 for bad arguments.
int32_t kubeinfer_qk_interleave(int32_t fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* dst,
                                int32_t threads) {
  if (!src || !dst || n < 0 || n % X16_ROWS || k <= 0 || k % QK_K) return 1;
  if (fmt >= FMT_Q5_K_ROWS && fmt <= FMT_Q2_K_ROWS) {
    const int tf = fmt - FMT_Q5_K_ROWS + FMT_Q5_K_X16;
    const int64_t nb = k / QK_K, tiles = n / X16_ROWS, tb = tile_bytes(tf), fb = file_block_bytes(tf);
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static) if (n * k > (1 << 16))
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* tile = dst + (t * nb + b) * tb;
        std::memset(tile, 0, tb);
        KFields f;
        for (int r = 0; r < X16_ROWS; ++r) {
          decode_block(tf, src + ((X16_ROWS * t + r) * nb + b) * fb, f);
          write_tile_row(tf, f, r, tile);
        }
      }
    return 0;
  }
  if (fmt != FMT_Q4_K && fmt != FMT_Q6_K) return 1;
  const int64_t nb = k / QK_K, tiles = n / X16_ROWS;
  const bool q6 = fmt == FMT_Q6_K;
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static) if (n * k > (1 << 16))
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* tile = dst + (t * nb + b) * (q6 ? Q6X_TILE_BYTES : X16_TILE_BYTES);
      if (q6) std::memset(tile, 0, Q6X_TILE_BYTES);  // qh is or-ed in below
      for (int r = 0; r < X16_ROWS; ++r) {
        const uint8_t* blk = src + ((X16_ROWS * t + r) * nb + b) * (q6 ? Q6_K_BYTES : Q4_K_BYTES);
        uint8_t v[QK_K];
        if (q6) {
          std::memcpy(tile + 2 * r, blk + 208, 2);
          for (int j = 0; j < 16; ++j) tile[q6x_sc(j / 2) + 2 * r + (j & 1)] = blk[192 + j];
          q6k_values(blk, v);
          for (int J = 0; J < 8; ++J)
            for (int g = 0; g < 4; ++g)
              for (int i = 0; i < 4; ++i) {
                const uint8_t a = v[32 * J + 4 * g + i], c = v[32 * J + 16 + 4 * g + i];
                tile[q6x_ql(J, g) + 4 * r + i] = (uint8_t)((a & 15) | ((c & 15) << 4));
                tile[q6x_qh(J, 0) + 4 * r + i] |= (uint8_t)((a >> 4) << (2 * g));
                tile[q6x_qh(J, 1) + 4 * r + i] |= (uint8_t)((c >> 4) << (2 * g));
              }
          continue;
        }
        std::memcpy(tile + 2 * r, blk, 2);
        std::memcpy(tile + 32 + 2 * r, blk + 2, 2);
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        q4k_values(blk, v);
        for (int j = 0; j < 8; ++j) {
          tile[X16_SC + 16 * j + r] = sc[j];
          tile[X16_MN + 32 * (j / 2) + 2 * r + (j & 1)] = mn[j];
          for (int g = 0; g < 4; ++g)
            for (int i = 0; i < 4; ++i)
              tile[X16_QS + (4 * j + g) * 64 + 4 * r + i] =
                  (uint8_t)(v[32 * j + 4 * g + i] | (v[32 * j + 16 + 4 * g + i] << 4));
        }
      }
    }
  return 0;
}

// Q5_K / IQ4_XS / Q3_K / Q2_K 16-row tiles of `fmt` (6..9) [n, k / 256 * row bytes] -> the file's rows
// again [n, k / 256 * block bytes] (kubeinfer_qk_interleave's inverse, byte for byte). Returns 0, or 1 for
// bad arguments.
int32_t kubeinfer_qk_deinterleave(int32_t fmt, const uint8_t* src, int64_t n, int64_t k, uint8_t* dst,
                                  int32_t threads) {
  if (!src || !dst || !new_tiles(fmt) || n < 0 || n % X16_ROWS || k <= 0 || k % QK_K) return 1;
  const int64_t nb = k / QK_K, tiles = n / X16_ROWS, tb = tile_bytes(fmt), fb = file_block_bytes(fmt);
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static) if (n * k > (1 << 16))
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      KFields f;
      for (int r = 0; r < X16_ROWS; ++r) {
        read_tile_row(fmt, src + (t * nb + b) * tb, r, f);
        encode_block(fmt, f, dst + ((X16_ROWS * t + r) * nb + b) * fb);
      }
    }
  return 0;
}

// Format code of a descriptor's super-blocks from its row bytes, or -1.
static int32_t desc_format(const KiQWeight* w) {
  if (!w || !w->q || w->bits != 6 || w->n < 0 || w->k <= 0) return -1;
  if (w->group_size == Q8X_GROUP) {  // 32-value tiles: Q8_0, Q5_0, IQ4_NL, Q5_1
    if (w->k % Q8X_BLOCK || w->n % X16_ROWS) return -1;
    if (w->row_bytes == w->k / Q8X_BLOCK * Q8X_ROW_BYTES) return FMT_Q8_0_X16;
    if (w->row_bytes == w->k / Q8X_BLOCK * Q5X_ROW_BYTES) return FMT_Q5_0_X16;
    if (w->row_bytes == w->k / Q8X_BLOCK * IQ4NLX_ROW_BYTES) return FMT_IQ4_NL_X16;
    if (w->row_bytes == w->k / Q8X_BLOCK * Q51X_ROW_BYTES) return FMT_Q5_1_X16;
    return -1;
  }
  if (w->k % QK_K) return -1;
  if (w->group_size == X16_GROUP) {  // 16-row tiles
    if (w->n % X16_ROWS) return -1;
    if (w->row_bytes == w->k / QK_K * X16_ROW_BYTES) return FMT_Q4_K_X16;
    if (w->row_bytes == w->k / QK_K * Q6_K_BYTES) return FMT_Q6_K_X16;
    for (int fmt = FMT_Q5_K_X16; fmt <= FMT_Q2_K_X16; ++fmt)
      if (w->row_bytes == w->k / QK_K * (tile_bytes(fmt) / X16_ROWS)) return fmt;
    return -1;
  }
  if (w->row_bytes == w->k / QK_K * Q4_K_BYTES) return FMT_Q4_K;
  if (w->row_bytes == w->k / QK_K * Q6_K_BYTES) return FMT_Q6_K;
  return -1;
}

// kubeinfer_qlinear's signature over a k-quant descriptor (qlinear.cpp hands these weights here):
// y = x @ W^T (+ bias); layers computing in bf16 or int8 (w->compute 1 or 2: gemm_dtype bf16 or int8) take
// int8 activations (kubeinfer_qk_linear), fp32 ones (0) fp32 activations (fp32_rows), as the int8 GEMV's
// default does for the repacked formats.
// 1 for a descriptor this file does not take.
int32_t kubeinfer_qk_qlinear(const KiQWeight* w, const float* x, int64_t m, int64_t x_stride, const float* bias,
                             float* y, int64_t y_stride, int32_t nthreads) {
  const int32_t fmt = desc_format(w);
  if (fmt < 0 || !x || !y || m < 0) return 1;
  int32_t rc = 0;
  if (w->compute == 0) {  // KI_COMPUTE_FP32: fp32 activations
    const int64_t n = w->n;
    const int nt = std::max<int32_t>(1, std::min<int64_t>(nthreads, std::max<int64_t>(1, n / 16)));
    over_spans(n, nt, [&](int64_t n0, int64_t n1) {
      fp32_rows(fmt, w->q, w->row_bytes, n0, n1, w->k, x, m, x_stride, y, y_stride);
    });
  } else if (w->compute == 1 && amx_min_rows > 0 && m >= amx_min_rows &&
             (fmt == FMT_Q4_K_X16 || fmt == FMT_Q6_K_X16)) {  // bf16 layers' batches on AMX tiles
    rc = kubeinfer_qk_linear_bf16(fmt, w->q, w->n, w->k, x, m, x_stride, y, y_stride, nthreads);
  } else {  // bf16 and int8 layers: int8 activations (the kernel above)
    rc = kubeinfer_qk_linear(fmt, w->q, w->n, w->k, x, m, x_stride, y, y_stride, nthreads);
  }
  if (rc == 0 && bias)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t n = 0; n < w->n; ++n) y[r * y_stride + n] += bias[n];
  return rc;
}

// out[i * out_stride + k] = W[rows ? rows[i] : row0 + i, k] in fp32 (dequant_row). 1 for a descriptor this
// file does not take.
int32_t kubeinfer_qk_dequant(const KiQWeight* w, const int64_t* rows, int64_t row0, int64_t nrows, float* out,
                             int64_t out_stride, int32_t nthreads) {
  const int32_t fmt = desc_format(w);
  if (fmt < 0 || nrows < 0) return 1;
#pragma omp parallel for num_threads(std::max(1, nthreads)) schedule(static) if (nrows * w->k > (1 << 16))
  for (int64_t i = 0; i < nrows; ++i)
    dequant_row(fmt, w->q, w->row_bytes, rows ? rows[i] : row0 + i, w->k, out + i * out_stride);
  return 0;
}

}  // extern "C"
#endif  // !KI_QK_KERNELS
