// ddtree's CPU GEMMs, y = x W^T with fp32 activations and outputs, for the few rows of decoding
// and tree verification (and any M):
//   blocks_mm  W kept as GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): weights="native"
//   float_mm   W float32 as nn.Linear holds it [N, K]: every fp32 linear on the CPU
//
// The order of every output's sum is fixed, whatever M, the tile a row lands in and the thread
// count: lane j (of LANES = 8; 16 in a build for AVX-512) sums x[k] w[k] over k = j mod 8 (16)
// in increasing k, one fused multiply-add each, starting from 0; then the lanes add in one fixed
// tree (sum_lanes; with 16, lanes j and j + 8 first). So row r of an M-row call is bitwise the
// 1-row call on that row (batch invariance): a tree's verify
// rows compute exactly what plain decoding of the same tokens computes, and a sequence's results
// never depend on which other sequences share its step.
//
// blocks_mm: each thread takes a share of the output columns (W's rows), TILE_N at a time. A
// tile's weights are decoded TILE_K inputs at a time into a small fp32 buffer that stays in L1
// (exactly as gguf.quants de-quantizes them: an fp16 scale times a small integer code is exact in
// fp32), and every activation row, up to PANEL_M of them, is multiplied against that buffer in
// register tiles of R rows x C columns; so a weight is read from memory and decoded once per
// PANEL_M rows, not once per few rows. Up to 5 rows (8 with AVX-512: plain decoding, a small
// tree's verify pass, a drafter's first depths) skip the buffer: each block is decoded in
// registers and used at once for every row. Its result is F.linear over the de-quantized weights
// up to the order of the float sums. With AVX-512 (SmolLM2's Q4_1 layers and Q8_0 head, 2 cores):
// 0.83x the AVX2 build's time at 5 rows, 0.8x at 6-8, 0.84x at 9-17, the same at one row.
//
// float_mm: see its section below.
//
// Built and loaded by workers/cpu_gemm.py (load_kernel); the ops are torch.ops.ddtree_cpu.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;    // weights per GGUF block
constexpr int64_t LANES = 8;     // partial sums per output (AVX2, and the scalar code)
#ifdef __AVX512F__
constexpr int64_t VLANES = 16;   // partial sums per output: the vectors' lanes
#else
constexpr int64_t VLANES = LANES;
#endif
constexpr int64_t TILE_N = 12;   // output columns decoded together (R x C tiles below divide it)
constexpr int64_t TILE_K = 256;  // inputs decoded together at most: a 12 KiB buffer
constexpr int64_t PANEL_M = 64;  // activation rows multiplied per decoded tile

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A hint to fetch the cache line at p; p may lie past the weights' end (a prefetch never faults).
inline void prefetch(const uint8_t* p) {
#ifdef __SSE__
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

// Block types: a stored block of VALUES weights in BYTES bytes, read GROUP = 32 weights (a
// group) at a time. decode_group(Block{}, row, g, w) gives group g of a weight row (its inputs
// 32 g .. 32 g + 31, in order) as vectors (or, in the scalar build, 32 floats), each weight
// exactly as gguf.quants de-quantizes it.
struct Q4_0 {
  static constexpr int64_t BYTES = 18, VALUES = 32;  // fp16 d, 16 bytes of codes: w = d (q - 8)
};
struct Q4_1 {
  static constexpr int64_t BYTES = 20, VALUES = 32;  // fp16 d, fp16 m, 16 bytes of codes: w = d q + m
};
struct Q8_0 {
  static constexpr int64_t BYTES = 34, VALUES = 32;  // fp16 d, 32 int8 codes: w = d q
};
// 5-bit codes: the 4-bit codes' bytes as in Q4_0, and bit l of a 32-bit qh the fifth bit of code l
struct Q5_0 {
  static constexpr int64_t BYTES = 22, VALUES = 32;  // fp16 d, qh, 16 bytes: w = d (q - 16)
};
struct Q5_1 {
  static constexpr int64_t BYTES = 24, VALUES = 32;  // fp16 d, fp16 m, qh, 16 bytes: w = d q + m
};
// K-quants: super-blocks of 256 weights, 8 groups of 32 (ggml's block_q4_K, block_q5_K, block_q6_K)
//   Q4_K  fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and minima m[8] (scale_min_k4), 128
//         bytes of 4-bit codes: group j reads the low (j even) or high (j odd) nibbles of bytes
//         32 (j / 2) .. 32 (j / 2) + 31; w = (d sc[j]) q - dmin m[j]
//   Q5_K  the same, with 32 bytes qh after the scales: bit j of qh[l] is the fifth bit of group
//         j's code l; w = (d sc[j]) q - dmin m[j]
//   Q6_K  128 bytes of low 4 bits ql, 64 bytes of high 2 bits qh, 16 int8 scales (one per 16
//         weights), fp16 d last; w = (d sc[i / 16]) (q - 32)
// Every product above is exact in fp32 (at most 24 significant bits), so w is the one rounding
// of its formula, as gguf.quants computes it in float32.
struct Q4_K {
  static constexpr int64_t BYTES = 144, VALUES = 256;
};
struct Q5_K {
  static constexpr int64_t BYTES = 176, VALUES = 256;
};
struct Q6_K {
  static constexpr int64_t BYTES = 210, VALUES = 256;
};

// The bytes of one weight row of `groups` groups.
template <typename Block>
constexpr int64_t row_bytes(int64_t groups) { return groups / (Block::VALUES / GROUP) * Block::BYTES; }

// Group j's 6-bit scale and minimum of a Q4_K / Q5_K super-block's 12 scale bytes s (ggml's
// get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, int j, float& sc, float& m) {
  if (j < 4) {
    sc = static_cast<float>(s[j] & 63);
    m = static_cast<float>(s[j + 4] & 63);
  } else {
    sc = static_cast<float>((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    m = static_cast<float>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// A group of Q5_0, Q5_1 or a K-quant: w[i] = scale[i / 16] * code[i] + offset[i / 16] (an exact
// product, one rounding; the codes from group_codes)
inline void group_affine(Q5_0, const uint8_t* b, int, float scale[2], float offset[2]) {
  scale[0] = scale[1] = half_at(b);
  offset[0] = offset[1] = -16.0f * scale[0];  // d (q - 16) = d q - 16 d, both exact
}
inline void group_affine(Q5_1, const uint8_t* b, int, float scale[2], float offset[2]) {
  scale[0] = scale[1] = half_at(b);
  offset[0] = offset[1] = half_at(b + 2);
}
inline void group_affine(Q4_K, const uint8_t* b, int j, float scale[2], float offset[2]) {
  float sc, m;
  scale_min_k4(b + 4, j, sc, m);
  scale[0] = scale[1] = half_at(b) * sc;
  offset[0] = offset[1] = -(half_at(b + 2) * m);
}
inline void group_affine(Q5_K, const uint8_t* b, int j, float scale[2], float offset[2]) {
  group_affine(Q4_K{}, b, j, scale, offset);
}
inline void group_affine(Q6_K, const uint8_t* b, int j, float scale[2], float offset[2]) {
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    scale[h] = d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * j + h]));
    offset[h] = -32.0f * scale[h];  // scale (q - 32) = scale q - 32 scale, both exact
  }
}

#ifdef __AVX2__
// 16 bytes of 4-bit codes -> codes 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles) as floats
inline void nibbles(const uint8_t* q, __m256 c[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// A block's weights as four vectors of eight (inputs 0-7, 8-15, 16-23, 24-31).
inline void decode(Q4_0, const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b)), eight = _mm256_set1_ps(8.0f);
  nibbles(b + 2, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_sub_ps(w[i], eight));  // q - 8 is exact
}

inline void decode(Q4_1, const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
  nibbles(b + 4, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, w[i], m);  // d q is exact: one rounding, as d q + m
}

inline void decode(Q8_0, const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
    w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
}

// A group's 32 codes (Q5_0, Q5_1, the K-quants) as bytes: c[0] codes 0-15, c[1] codes 16-31.
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// 16 bytes of 4-bit codes and their 32 fifth bits qh -> 5-bit codes 0-15, 16-31
inline void five_bit_codes(const uint8_t* qh, const uint8_t* qs, __m128i c[2]) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  const __m128i h = _mm_set1_epi32(static_cast<int>(bits)), mask = _mm_set1_epi8(0x0F), sixteen = _mm_set1_epi8(16);
  const __m128i which = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i bytes = load16(qs);
  const __m128i low[2] = {_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)};
  const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int half = 0; half < 2; ++half) {  // code 16 half + l: bit l % 8 of qh's byte 2 half + l / 8
    const __m128i picked = _mm_shuffle_epi8(half ? _mm_srli_epi32(h, 16) : h, pick);
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(picked, which), which);
    c[half] = _mm_or_si128(low[half], _mm_and_si128(set, sixteen));
  }
}

inline void group_codes(Q5_0, const uint8_t* b, int, __m128i c[2]) { five_bit_codes(b + 2, b + 6, c); }
inline void group_codes(Q5_1, const uint8_t* b, int, __m128i c[2]) { five_bit_codes(b + 4, b + 8, c); }

inline void group_codes(Q4_K, const uint8_t* b, int j, __m128i c[2]) {
  const uint8_t* q = b + 16 + 32 * (j / 2);
  const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1)), mask = _mm_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) c[h] = _mm_and_si128(_mm_srl_epi16(load16(q + 16 * h), shift), mask);
}

inline void group_codes(Q5_K, const uint8_t* b, int j, __m128i c[2]) {
  const uint8_t* q = b + 48 + 32 * (j / 2);
  const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1)), mask = _mm_set1_epi8(0x0F), one = _mm_set1_epi8(1);
  const __m128i bit = _mm_cvtsi32_si128(j);
  for (int h = 0; h < 2; ++h) {
    const __m128i high = _mm_and_si128(_mm_srl_epi16(load16(b + 16 + 16 * h), bit), one);  // bit j of each byte
    c[h] = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(load16(q + 16 * h), shift), mask), _mm_slli_epi16(high, 4));
  }
}

inline void group_codes(Q6_K, const uint8_t* b, int j, __m128i c[2]) {
  const int half = j / 4, u = j % 4;  // group j: 128 weights' half, and which 32 of them
  const uint8_t* ql = b + 64 * half + 32 * (u & 1);
  const uint8_t* qh = b + 128 + 32 * half;
  const __m128i low_shift = _mm_cvtsi32_si128(4 * (u >> 1)), high_shift = _mm_cvtsi32_si128(2 * u);
  const __m128i mask = _mm_set1_epi8(0x0F), three = _mm_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m128i high = _mm_and_si128(_mm_srl_epi16(load16(qh + 16 * h), high_shift), three);
    c[h] = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(load16(ql + 16 * h), low_shift), mask), _mm_slli_epi16(high, 4));
  }
}

// Group j of a K-quant super-block (a Q5_0 / Q5_1 block: j = 0) as four vectors of eight.
template <typename Block>
inline void decode(Block, const uint8_t* b, int j, __m256 w[4]) {
  __m128i c[2];
  float scale[2], offset[2];
  group_codes(Block{}, b, j, c);
  group_affine(Block{}, b, j, scale, offset);
  for (int i = 0; i < 4; ++i) {
    const __m128i bytes = i % 2 ? _mm_srli_si128(c[i / 2], 8) : c[i / 2];
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    w[i] = _mm256_fmadd_ps(_mm256_set1_ps(scale[i / 2]), q, _mm256_set1_ps(offset[i / 2]));
  }
}

inline void decode(Q5_0, const uint8_t* b, __m256 w[4]) { decode(Q5_0{}, b, 0, w); }
inline void decode(Q5_1, const uint8_t* b, __m256 w[4]) { decode(Q5_1{}, b, 0, w); }

inline float sum_lanes(__m256 v) {  // ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

#ifdef __AVX512F__
// 16 lanes: lanes j and j + 8 pairwise, then the 8-lane tree
inline float sum_lanes(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return sum_lanes(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}

// 16 bytes of 4-bit codes -> codes 0-15 (low nibbles), 16-31 (high nibbles) as floats
inline void nibbles(const uint8_t* q, __m512 c[2]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  c[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}

// A block's weights as two vectors of sixteen (inputs 0-15, 16-31): the same values as the
// AVX2 decode's, element by element.
inline void decode(Q4_0, const uint8_t* b, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(half_at(b)), eight = _mm512_set1_ps(8.0f);
  nibbles(b + 2, w);
  for (int i = 0; i < 2; ++i) w[i] = _mm512_mul_ps(d, _mm512_sub_ps(w[i], eight));
}

inline void decode(Q4_1, const uint8_t* b, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(half_at(b + 2));
  nibbles(b + 4, w);
  for (int i = 0; i < 2; ++i) w[i] = _mm512_fmadd_ps(d, w[i], m);
}

inline void decode(Q8_0, const uint8_t* b, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  for (int i = 0; i < 2; ++i) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * i));
    w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
}

// Group j of a K-quant super-block (a Q5_0 / Q5_1 block: j = 0) as two vectors of sixteen.
template <typename Block>
inline void decode(Block, const uint8_t* b, int j, __m512 w[2]) {
  __m128i c[2];
  float scale[2], offset[2];
  group_codes(Block{}, b, j, c);
  group_affine(Block{}, b, j, scale, offset);
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_fmadd_ps(_mm512_set1_ps(scale[i]), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c[i])),
                           _mm512_set1_ps(offset[i]));
}

inline void decode(Q5_0, const uint8_t* b, __m512 w[2]) { decode(Q5_0{}, b, 0, w); }
inline void decode(Q5_1, const uint8_t* b, __m512 w[2]) { decode(Q5_1{}, b, 0, w); }

// The vectors the GEMMs' loops below are written in: VLANES floats.
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload_aligned(const float* p) { return _mm512_load_ps(p); }
inline void vstore_aligned(float* p, Vec v) { _mm512_store_ps(p, v); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vsplat(float v) { return _mm512_set1_ps(v); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
#else
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload_aligned(const float* p) { return _mm256_load_ps(p); }
inline void vstore_aligned(float* p, Vec v) { _mm256_store_ps(p, v); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vsplat(float v) { return _mm256_set1_ps(v); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
#endif
constexpr int BLOCK_VECTORS = GROUP / VLANES;  // a decoded block's vectors

// VLANES partial sums at a (aligned to the vector)
inline float sum_lanes(const float* a) { return sum_lanes(vload_aligned(a)); }

// Group g of a weight row (see the block types above) as BLOCK_VECTORS vectors.
template <typename Block>
inline void decode_group(Block, const uint8_t* row, int64_t g, Vec w[BLOCK_VECTORS]) {
  constexpr int64_t SUBS = Block::VALUES / GROUP;
  if constexpr (SUBS == 1) decode(Block{}, row + g * Block::BYTES, w);
  else decode(Block{}, row + g / SUBS * Block::BYTES, static_cast<int>(g % SUBS), w);
}

template <typename Block>
inline void decode_block(Block, const uint8_t* row, int64_t g, float* w) {
  Vec v[BLOCK_VECTORS];
  decode_group(Block{}, row, g, v);
  for (int i = 0; i < BLOCK_VECTORS; ++i) vstore_aligned(w + VLANES * i, v[i]);
}

// acc[r][c][0..VLANES) += the products of R activation rows (x, row stride K) and C decoded
// weight columns (w, stride TILE_K) over `steps` spans of VLANES inputs; acc rows are
// TILE_N * VLANES apart.
template <int R, int C>
inline void multiply_tile(const float* x, int64_t K, const float* w, float* acc, int64_t steps) {
  Vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = vload_aligned(acc + (r * TILE_N + c) * VLANES);
  int64_t s = 0;
  do {  // steps >= 1; with a for loop GCC copied the 12 accumulators through the stack per call (-17%)
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload_aligned(w + c * TILE_K + s * VLANES);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * K + s * VLANES);
      for (int c = 0; c < C; ++c) a[r][c] = vfmadd(wv[c], xv, a[r][c]);
    }
  } while (++s < steps);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore_aligned(acc + (r * TILE_N + c) * VLANES, a[r][c]);
}

// R activation rows (1-5, or 1-8 with AVX-512: plain decoding, a verify pass over a small tree,
// a drafter's first depths) times C weight rows, each block decoded in registers once and used
// at once for all R rows: the buffer of `tiles` pays for its stores and loads only when more rows
// share a decoded block. The same sums as multiply_tile's, lane j adding k = j, j + VLANES, ...
// in order.
template <typename Block, int R, int C>
inline void few_rows(const float* x, int64_t K, const uint8_t* rows, int64_t groups, float* y, int64_t N) {
  const int64_t stride = row_bytes<Block>(groups);
  Vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xs = x + g * GROUP;
    for (int c = 0; c < C; ++c) {
      Vec w[BLOCK_VECTORS];
      // the same block of the next C rows: reading C rows side by side left the hardware's
      // prefetcher behind (the Q8_0 LM head ran at a third of the old kernel's speed without it)
      prefetch(rows + (c + C) * stride + g * Block::BYTES * GROUP / Block::VALUES);
      decode_group(Block{}, rows + c * stride, g, w);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < BLOCK_VECTORS; ++i) a[r][c] = vfmadd(w[i], vload(xs + r * K + VLANES * i), a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * N + c] = sum_lanes(a[r][c]);
}

template <typename Block, int R>
void few_rows_columns(const float* x, const uint8_t* blocks, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  // 4-10 sums in flight, and no spills (one row with 6 spilled them with GCC)
#ifdef __AVX512F__
  constexpr int C = R <= 2 ? 4 : R <= 4 ? 3 : 2;
#else
  constexpr int C = R <= 2 ? 4 : R == 3 ? 3 : 2;
#endif
  const int64_t groups = K / GROUP;
  int64_t n = n0;
  for (; n + C <= n1; n += C) few_rows<Block, R, C>(x, K, blocks + n * row_bytes<Block>(groups), groups, y + n, N);
  for (; n < n1; ++n) few_rows<Block, R, 1>(x, K, blocks + n * row_bytes<Block>(groups), groups, y + n, N);
}

#else
inline void decode(Q4_0, const uint8_t* b, float* w) {
  const float d = half_at(b);
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>((b[2 + j] & 0x0F) - 8);
    w[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
  }
}

inline void decode(Q4_1, const uint8_t* b, float* w) {
  const float d = half_at(b), m = half_at(b + 2);
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>(b[4 + j] & 0x0F) + m;
    w[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
  }
}

inline void decode(Q8_0, const uint8_t* b, float* w) {
  const float d = half_at(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
}

// A group's 32 codes as bytes.
inline void five_bit_codes(const uint8_t* qh, const uint8_t* qs, uint8_t c[32]) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  for (int l = 0; l < 32; ++l) c[l] = ((l < 16 ? qs[l] : qs[l - 16] >> 4) & 0x0F) | (((bits >> l) & 1) << 4);
}
inline void group_codes(Q5_0, const uint8_t* b, int, uint8_t c[32]) { five_bit_codes(b + 2, b + 6, c); }
inline void group_codes(Q5_1, const uint8_t* b, int, uint8_t c[32]) { five_bit_codes(b + 4, b + 8, c); }

inline void group_codes(Q4_K, const uint8_t* b, int j, uint8_t c[32]) {
  const uint8_t* q = b + 16 + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) c[l] = (q[l] >> (4 * (j & 1))) & 0x0F;
}

inline void group_codes(Q5_K, const uint8_t* b, int j, uint8_t c[32]) {
  const uint8_t* q = b + 48 + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) c[l] = ((q[l] >> (4 * (j & 1))) & 0x0F) | (((b[16 + l] >> j) & 1) << 4);
}

inline void group_codes(Q6_K, const uint8_t* b, int j, uint8_t c[32]) {
  const int half = j / 4, u = j % 4;
  const uint8_t* ql = b + 64 * half + 32 * (u & 1);
  const uint8_t* qh = b + 128 + 32 * half;
  for (int l = 0; l < 32; ++l) c[l] = ((ql[l] >> (4 * (u >> 1))) & 0x0F) | (((qh[l] >> (2 * u)) & 3) << 4);
}

template <typename Block>
inline void decode(Block, const uint8_t* b, int j, float* w) {
  uint8_t c[32];
  float scale[2], offset[2];
  group_codes(Block{}, b, j, c);
  group_affine(Block{}, b, j, scale, offset);
  for (int l = 0; l < 32; ++l) w[l] = scale[l / 16] * static_cast<float>(c[l]) + offset[l / 16];  // an exact product
}

inline void decode(Q5_0, const uint8_t* b, float* w) { decode(Q5_0{}, b, 0, w); }
inline void decode(Q5_1, const uint8_t* b, float* w) { decode(Q5_1{}, b, 0, w); }

template <typename Block>
inline void decode_block(Block, const uint8_t* row, int64_t g, float* w) {
  constexpr int64_t SUBS = Block::VALUES / GROUP;
  if constexpr (SUBS == 1) decode(Block{}, row + g * Block::BYTES, w);
  else decode(Block{}, row + g / SUBS * Block::BYTES, static_cast<int>(g % SUBS), w);
}

inline float sum_lanes(const float* a) {  // the AVX2 tree, in scalar code
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

template <int R, int C>
inline void multiply_tile(const float* x, int64_t K, const float* w, float* acc, int64_t steps) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float* a = acc + (r * TILE_N + c) * LANES;
      for (int64_t s = 0; s < steps; ++s)
        for (int j = 0; j < LANES; ++j) a[j] += w[c * TILE_K + s * LANES + j] * x[r * K + s * LANES + j];
    }
}
#endif

// Register tiles of R rows x C columns: C = TILE_N / R keeps 12 accumulators for any R (AVX2).
template <int R>
void multiply_rows(const float* x, int64_t K, const float* w, float* acc, int64_t columns, int64_t steps) {
#ifdef __AVX512F__
  constexpr int C = R == 1 ? 12 : 6;  // up to 24 of the 32 registers: 0.85x the time of TILE_N / R at 9-33 rows
#else
  constexpr int C = TILE_N / R;
#endif
  int64_t c = 0;
  for (; c + C <= columns; c += C) multiply_tile<R, C>(x, K, w + c * TILE_K, acc + c * VLANES, steps);
  for (; c < columns; ++c) multiply_tile<R, 1>(x, K, w + c * TILE_K, acc + c * VLANES, steps);
}

// Output columns of tiles [t0, t1) of y [M, N] from x [M, K] and W's blocks [N, K / 32, BYTES].
template <typename Block>
void tiles(const float* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  alignas(64) float w[TILE_N * TILE_K];             // decoded weights [column][input]
  alignas(64) float acc[PANEL_M * TILE_N * VLANES];  // partial sums [row][column][lane]
  const int64_t groups = K / GROUP;
  const int64_t chunks = std::max<int64_t>(1, (K + TILE_K - 1) / TILE_K);
  const int64_t span = (groups + chunks - 1) / chunks * GROUP;  // inputs per chunk, chunks of even size
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * TILE_N, columns = std::min(TILE_N, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += PANEL_M) {
      const int64_t rows = std::min(PANEL_M, M - m0);
      std::fill(acc, acc + rows * TILE_N * VLANES, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += span) {
        const int64_t width = std::min(span, K - k0);
        for (int64_t c = 0; c < columns; ++c) {
          const uint8_t* row = blocks + (n0 + c) * row_bytes<Block>(groups);
          for (int64_t g = k0 / GROUP; g < (k0 + width) / GROUP; ++g) {
            // the next tile's block (see few_rows)
            prefetch(row + TILE_N * row_bytes<Block>(groups) + g * Block::BYTES * GROUP / Block::VALUES);
            decode_block(Block{}, row, g, w + c * TILE_K + (g - k0 / GROUP) * GROUP);
          }
        }
        const float* xs = x + m0 * K + k0;
        const int64_t steps = width / VLANES;
        int64_t m = 0;
        for (; m + 4 <= rows; m += 4) multiply_rows<4>(xs + m * K, K, w, acc + m * TILE_N * VLANES, columns, steps);
        switch (rows - m) {
          case 3: multiply_rows<3>(xs + m * K, K, w, acc + m * TILE_N * VLANES, columns, steps); break;
          case 2: multiply_rows<2>(xs + m * K, K, w, acc + m * TILE_N * VLANES, columns, steps); break;
          case 1: multiply_rows<1>(xs + m * K, K, w, acc + m * TILE_N * VLANES, columns, steps); break;
        }
      }
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = 0; c < columns; ++c) y[(m0 + m) * N + n0 + c] = sum_lanes(acc + (m * TILE_N + c) * VLANES);
    }
  }
}

template <typename Block>
void run(const float* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K) {
  // A task of about 64 KiB of weights at one row, fewer as rows add multiplications, so that
  // small matrices at one row stay on one thread and a tree's rows split even small ones.
  const int64_t tile_bytes = TILE_N * row_bytes<Block>(K / GROUP);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, tile_bytes * (1 + std::min(M, PANEL_M) / 4)));
  at::parallel_for(0, (N + TILE_N - 1) / TILE_N, grain, [&](int64_t t0, int64_t t1) {
#ifdef __AVX2__
    const int64_t n0 = t0 * TILE_N, n1 = std::min(N, t1 * TILE_N);
    switch (M) {
      case 1: return few_rows_columns<Block, 1>(x, blocks, y, N, K, n0, n1);
      case 2: return few_rows_columns<Block, 2>(x, blocks, y, N, K, n0, n1);
      case 3: return few_rows_columns<Block, 3>(x, blocks, y, N, K, n0, n1);
      case 4: return few_rows_columns<Block, 4>(x, blocks, y, N, K, n0, n1);
      case 5: return few_rows_columns<Block, 5>(x, blocks, y, N, K, n0, n1);
#ifdef __AVX512F__  // 32 registers hold the sums of up to 8 rows (0.8x the time of tiles at 6-8 rows)
      case 6: return few_rows_columns<Block, 6>(x, blocks, y, N, K, n0, n1);
      case 7: return few_rows_columns<Block, 7>(x, blocks, y, N, K, n0, n1);
      case 8: return few_rows_columns<Block, 8>(x, blocks, y, N, K, n0, n1);
#endif
    }
#endif
    tiles<Block>(x, blocks, y, M, N, K, t0, t1);
  });
}

// x [M, K] float32, blocks [N, K / values per block, bytes per block] uint8 -> [M, N] float32
at::Tensor blocks_mm(const at::Tensor& x, const at::Tensor& blocks, const std::string& kind) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "ddtree_cpu.blocks_mm runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be a [M, K] float32 tensor");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3, "blocks must be [N, K / 32, bytes] uint8");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t bytes = blocks.size(2);
  bool known = false;
  auto dispatch = [&](auto block, const char* name) {
    using Block = decltype(block);
    if (known || kind != name || bytes != Block::BYTES) return;
    known = true;
    TORCH_CHECK(blocks.size(1) * Block::VALUES == K, "blocks cover ", blocks.size(1) * Block::VALUES, " inputs, x has ", K);
    run<Block>(xp, bp, yp, M, N, K);
  };
  dispatch(Q4_0{}, "Q4_0");
  dispatch(Q4_1{}, "Q4_1");
  dispatch(Q5_0{}, "Q5_0");
  dispatch(Q5_1{}, "Q5_1");
  dispatch(Q8_0{}, "Q8_0");
  dispatch(Q4_K{}, "Q4_K");
  dispatch(Q5_K{}, "Q5_K");
  dispatch(Q6_K{}, "Q6_K");
  TORCH_CHECK(known, "unsupported block type ", kind, " with ", bytes, " bytes per block");
  return y;
}

// --- float_mm: W float32 [N, K], read where it lies ------------------------------------------
//
// Register tiles of R activation rows x C weight rows: each step of VLANES inputs loads C
// weight vectors and R activation vectors for R * C fused multiply-adds, the accumulators held
// in registers over the whole of K (no partial sums in memory). A thread takes FLOAT_TILE_N
// output columns at a time and passes the rows over them, all together up to FLOAT_ONE_GROUP
// rows, else in groups of at most FLOAT_GROUP: the tile's weights come from memory once per
// call, whatever M, and from L1/L2 for the later groups; meanwhile the tile after next is
// prefetched into L2, so the stream from memory goes on while the rows multiply. The last
// K mod VLANES inputs add one by one after the lanes' sum, in order.
//
// AVX2 (16 vector registers): 8 lanes, rows in groups of 4 and 3 (2 when M is 2 or 5), 12
// accumulators per tile. Measured on a 2-core AVX2 machine over SmolLM2's matrices (30 layers
// of q/k/v, o, gate/up, down, plus the LM head; benchmarks/verify_cost.py has the whole
// forward): 18.5-20.5 ms at 1 row against oneDNN's 28-33 ms, 25-31 ms at 9 rows against 59-75,
// 38-49 at 17 against 71-93; at 256-512 rows (a prefill) within 0-20% of oneDNN.
//
// AVX-512 (32 registers, where torch reports the capability and the kernel is built with
// -mavx512f): 16 lanes -- lane j sums k = j mod 16, and the lanes add as j and j + 8 pairwise,
// then sum_lanes' tree: a fixed order as with 8 lanes, so rows stay batch-invariant (another
// order than the AVX2 build's; cpu_gemm.kernel_key names the build). Up to 9 rows pass over a
// tile together, in tiles of up to 24 accumulators; more rows go in groups of at most 5 (tiles of
// 4 x 6 and 5 x 4). The lanes of a tile's sums are added 16 vectors at a time (lane_sums: the
// same tree, the pairs moved side by side by shuffles; 45 instructions for 16 sums instead of
// 128). The prefetches go in pairs of lines (the 128 bytes the L2's adjacent-line prefetcher
// fetches together): with one line each, an even number of groups left one group fetching every pair
// (5-8 and 13-16 rows took 1.2-1.3x the time of 9-12 and 17). Measured on the 2-core AVX-512
// machine (SmolLM2's matrices, ms, interleaved with the AVX2 build of the same source):
//   rows        1     5     9     12    17    33    256
//   AVX2      19.7  32.7  29.6  31.9  37.6  56.1  381
//   AVX-512   19.4  22.1  27.2  29.4  34.7  45.6  273
// Single tiles of 8-12 rows x 2-3 columns run at ~0.75x the multiply-adds per second of 4 x 6
// and 5 x 5 ones (11-14 loads per 24 multiply-adds, L1-resident); up to 9 rows one pass over the
// weights still pays (in the whole forward 8 rows took 0.96x, 9 rows 0.99x the time of two
// groups), past 9 the groups of at most 5 do. With lane_sums, against the build before them (ms,
// the same run):
//   rows        1     5     8     9     12    17    33    128   256
//   before    19.9  23.1  25.8  28.0  30.3  36.3  48.8  153   301
//   now       20.2  23.1  25.8  28.5  30.7  34.0  45.4  146   302

constexpr int64_t FLOAT_TILE_N = 12;  // output columns per task step (every tile's C divides it)

#ifdef __AVX512F__
constexpr int64_t FLOAT_ONE_GROUP = 9;
constexpr int64_t FLOAT_GROUP = 5;
constexpr int64_t PREFETCH_LINES = 2;  // 64-byte lines fetched together

// R x C accumulators, C weight vectors and a row vector in 32 registers (7 x 4 is one over, and
// measured as fast as 7 x 3); one row takes 4 columns at a time (it waits on memory anyway)
constexpr int float_columns(int R) { return R == 1 ? 4 : R <= 4 ? 6 : R <= 7 ? 4 : R == 8 ? 3 : 2; }
#else
constexpr int64_t FLOAT_ONE_GROUP = 4;
constexpr int64_t FLOAT_GROUP = 4;
constexpr int64_t PREFETCH_LINES = 1;

// 12 accumulators for any R (16 registers); one row takes 4 columns at a time (12 would load 12
// weight vectors per row of FMAs)
constexpr int float_columns(int R) { return R == 1 ? 4 : 12 / R; }
#endif
constexpr int64_t PREFETCH_SPAN = 16 * PREFETCH_LINES;  // inputs per prefetch step

// A hint to fetch the cache line at p into L2 (L1 holds the tile being multiplied).
inline void prefetch_l2(const float* p) {
#ifdef __SSE__
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

#ifdef __AVX512F__
// sum_lanes of many vectors at once, the same additions in the same tree: lanes j and j + 8,
// then j and j + 4, j and j + 2, j and j + 1 -- each step adds two vectors' worth of pairs in
// one vector (the pairs moved side by side by shuffles), so 16 sums take 15 vector adds and 30
// shuffles instead of 16 x 8 instructions.
inline __m512 halves(__m512 a, __m512 b) {  // lanes 0-7: a_j + a_{j+8}; 8-15: the same of b
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 quarters(__m512 a, __m512 b) {  // 8-lane halves h of a, b: h_j + h_{j+4}, 4 lanes each
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
inline __m512 pairs(__m512 a, __m512 b) {  // in each 128-bit lane: a0 + a2, a1 + a3, b0 + b2, b1 + b3
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
inline __m512 ones(__m512 a, __m512 b) {  // in each 128-bit lane: a0 + a1, a2 + a3, b0 + b1, b2 + b3
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// out[i] = sum_lanes(v[i]) for i < n
template <int n>
inline void lane_sums(const __m512* v, float* out) {
  alignas(64) float s[16];
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512* u = v + i;
    const __m512 t0 = quarters(halves(u[0], u[1]), halves(u[2], u[3]));
    const __m512 t1 = quarters(halves(u[4], u[5]), halves(u[6], u[7]));
    const __m512 t2 = quarters(halves(u[8], u[9]), halves(u[10], u[11]));
    const __m512 t3 = quarters(halves(u[12], u[13]), halves(u[14], u[15]));
    _mm512_store_ps(s, ones(pairs(t0, t1), pairs(t2, t3)));
    for (int m = 0; m < 16; ++m) out[i + m] = s[4 * (m & 3) + 2 * (m >> 3) + ((m >> 2) & 1)];
  }
  if (i + 8 <= n) {
    const __m512* u = v + i;
    const __m512 t0 = quarters(halves(u[0], u[1]), halves(u[2], u[3]));
    const __m512 t1 = quarters(halves(u[4], u[5]), halves(u[6], u[7]));
    const __m512 p = pairs(t0, t1);
    _mm512_store_ps(s, ones(p, p));
    for (int m = 0; m < 8; ++m) out[i + m] = s[4 * (m & 3) + (m >> 2)];
    i += 8;
  }
  if (i + 4 <= n) {
    const __m512* u = v + i;
    const __m512 t = quarters(halves(u[0], u[1]), halves(u[2], u[3]));
    const __m512 p = pairs(t, t);
    _mm512_store_ps(s, ones(p, p));
    for (int m = 0; m < 4; ++m) out[i + m] = s[4 * m];
    i += 4;
  }
  for (; i < n; ++i) out[i] = sum_lanes(v[i]);
}
#endif

// y[r, c] (row stride N) for R rows of x and C rows of w (both row stride K); `next`, if not
// null, is weight rows to prefetch meanwhile (a later tile's, the same offsets): PREFETCH_LINES
// 64-byte lines at inputs phase, phase + every, ... (each group of rows of a tile fetches its
// share, so that the fetches spread over the whole tile's multiplications).
template <int R, int C>
inline void float_tile(const float* x, const float* w, float* y, int64_t N, int64_t K, const float* next,
                       int64_t phase = 0, int64_t every = PREFETCH_SPAN) {
  const int64_t body = K - K % VLANES;
  int64_t due = next != nullptr ? phase : K;  // the input at which the next lines are fetched
#ifdef __AVX2__
  Vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = vzero();
  for (int64_t k = 0; k < body; k += VLANES) {
    if (k == due) {
      for (int c = 0; c < C; ++c)
        for (int64_t line = 0; line < PREFETCH_LINES; ++line) prefetch_l2(next + c * K + k + 16 * line);
      due += every;
    }
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * K + k);
      for (int c = 0; c < C; ++c) a[r][c] = vfmadd(wv[c], xv, a[r][c]);
    }
  }
#else
  (void)due;
  alignas(32) float a[R][C][LANES] = {};
  for (int64_t k = 0; k < body; k += LANES)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < LANES; ++j) a[r][c][j] = std::fma(w[c * K + k + j], x[r * K + k + j], a[r][c][j]);
#endif
#ifdef __AVX512F__
  float sums[R][C];
  lane_sums<R * C>(&a[0][0], &sums[0][0]);
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
#ifdef __AVX512F__
      float sum = sums[r][c];
#else
      float sum = sum_lanes(a[r][c]);
#endif
      for (int64_t k = body; k < K; ++k) sum = std::fma(w[c * K + k], x[r * K + k], sum);
      y[r * N + c] = sum;
    }
}

// R rows of x against `columns` (<= FLOAT_TILE_N) rows of w, float_columns(R) at a time.
template <int R>
void float_rows(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t columns, const float* next,
                int64_t phase = 0, int64_t every = PREFETCH_SPAN) {
  constexpr int C = float_columns(R);
  int64_t c = 0;
  for (; c + C <= columns; c += C)
    float_tile<R, C>(x, w + c * K, y + c, N, K, next == nullptr ? nullptr : next + c * K, phase, every);
  for (; c < columns; ++c) float_tile<R, 1>(x, w + c * K, y + c, N, K, nullptr);
}

// A group of `rows` (2 ... max(FLOAT_ONE_GROUP, FLOAT_GROUP)) rows against one tile.
void float_group(int64_t rows, const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t columns,
                 const float* next, int64_t phase, int64_t every) {
  switch (rows) {
#ifdef __AVX512F__
    case 9: return float_rows<9>(x, w, y, N, K, columns, next, phase, every);
    case 8: return float_rows<8>(x, w, y, N, K, columns, next, phase, every);
    case 7: return float_rows<7>(x, w, y, N, K, columns, next, phase, every);
    case 6: return float_rows<6>(x, w, y, N, K, columns, next, phase, every);
    case 5: return float_rows<5>(x, w, y, N, K, columns, next, phase, every);
#endif
    case 4: return float_rows<4>(x, w, y, N, K, columns, next, phase, every);
    case 3: return float_rows<3>(x, w, y, N, K, columns, next, phase, every);
    default: return float_rows<2>(x, w, y, N, K, columns, next, phase, every);
  }
}

void float_run(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + FLOAT_TILE_N - 1) / FLOAT_TILE_N;
  // about 64 KiB of weights per task at one row, fewer as rows add multiplications (as run's)
  const int64_t tile_bytes = FLOAT_TILE_N * K * static_cast<int64_t>(sizeof(float));
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, tile_bytes * (1 + std::min<int64_t>(M, 64) / 4)));
  // groups of as even a size as FLOAT_GROUP allows (never one row alone when M > 1: a lone
  // row's tile keeps 4 sums in flight and runs at about a third of the others' rate)
  const int64_t groups = M <= FLOAT_ONE_GROUP ? 1 : (M + FLOAT_GROUP - 1) / FLOAT_GROUP;
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * FLOAT_TILE_N, columns = std::min(FLOAT_TILE_N, N - n0);
      const float* wt = w + n0 * K;
      // the tile after next of this task, fetched while the row groups pass over this one (one
      // tile ahead, or all of it fetched by the first group, measured 7-15% slower at 9-17 rows)
      const float* next = t + 2 < t1 && N - n0 >= 3 * FLOAT_TILE_N ? wt + 2 * FLOAT_TILE_N * K : nullptr;
      if (M == 1) {
        float_rows<1>(x, wt, y + n0, N, K, columns, next);
        continue;
      }
      int64_t m = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t rows = (M - m) / (groups - g);
        float_group(rows, x + m * K, wt, y + m * N + n0, N, K, columns, next, PREFETCH_SPAN * g, PREFETCH_SPAN * groups);
        m += rows;
      }
    }
  });
}

// x [M, K] float32, w [N, K] float32 -> [M, N] float32
at::Tensor float_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "ddtree_cpu.float_mm runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be a [M, K] float32 tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "w must be a [N, K] float32 tensor");
  TORCH_CHECK(w.size(1) == x.size(1), "w has ", w.size(1), " inputs, x has ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) float_run(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  return y;
}


// --- tree attention ------------------------------------------------------------------------------
//
// tree_attention: the attention of a verify or decode step's few query rows per sequence over
// keys and values read in place from the KV storage (the paged pool, or a dense cache), with the
// same fixed-order arithmetic for every row: a row's result depends only on its own query and
// the keys it sees, never on the other rows of its step. Row i of sequence b sees its context
// (positions 0 ... lengths[b] - 1) and the block positions lengths[b] + j with mask[b, i, j], in
// that order -- the order plain decoding sees the same keys in once a tree's accepted path is
// committed (a node's ancestors precede it in the block, in depth order). So with float_mm's
// batch-invariant linears a tree's verify row computes bitwise what plain decoding of the same
// token computes.
//
// Per row: scores s_k = (q . key_k) * scale (8 lanes over the head dimension, then sum_lanes'
// tree), m = max s_k, p_k = exp(s_k - m) (expf_lanes: a fixed polynomial, < 2 ulp), l = the sum
// of p_k in key order, out = (sum over k in key order of p_k v_k) / l.

#ifdef __AVX2__
constexpr int64_t HEAD_LANES = 8;

// exp(x) for one x <= 0 (softmax's shifted scores): 2^round(x / ln 2) times a degree-6
// polynomial of the remainder. expf_lanes computes the same operations 8 at a time (a vector
// fused multiply-add rounds exactly as std::fma), so every result is the same whatever its place.
inline float expf_one(float x) {
  const float v = std::max(x, -87.0f);
  const float k = std::floor(std::fma(v, 1.44269504088896341f, 0.5f));
  float r = std::fma(k, -0.693359375f, v);
  r = std::fma(k, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(k) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

void expf_lanes(float* x, int64_t n) {
  const __m256 lo = _mm256_set1_ps(-87.0f), log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
  const __m256 c1 = _mm256_set1_ps(-0.693359375f), c2 = _mm256_set1_ps(2.12194440e-4f), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + HEAD_LANES <= n; i += HEAD_LANES) {
    const __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + i), lo);
    const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(v, log2e, half));
    __m256 r = _mm256_fmadd_ps(k, c1, v);
    r = _mm256_fmadd_ps(k, c2, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), one);
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23);
    _mm256_storeu_ps(x + i, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e)));
  }
  for (; i < n; ++i) x[i] = expf_one(x[i]);
}

// q . key over D (a multiple of 8): lane j sums q[d] key[d] over d = j mod 8, then sum_lanes.
inline float head_dot(const float* q, const float* key, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += HEAD_LANES) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(key + d), acc);
  return sum_lanes(acc);
}

// sum_lanes of four vectors at once, each by the same tree: (a0 + a4, a1 + a5, a2 + a6, a3 + a7)
// from the halves, reordered (h0, h2, h1, h3) so that one horizontal add pairs h0 + h2 and h1 +
// h3 and the next adds those two (a sum's operands may swap: IEEE addition commutes exactly).
inline __m128 sum_lanes4(const __m256 a[4]) {
  const __m256 h01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
  const __m256 h23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
  __m256 y = _mm256_hadd_ps(_mm256_permute_ps(h01, 0xD8), _mm256_permute_ps(h23, 0xD8));
  y = _mm256_hadd_ps(y, y);  // low half (s0, s2, s0, s2), high half (s1, s3, s1, s3)
  return _mm_unpacklo_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// scores[r][t] = (q[r] . key t) * scale for R query rows over the same n keys at element offsets
// keys[t]: an R x 4 tile of (row, key) chains per step, each key's vector loaded once for the R
// rows, the four keys' lanes summed together (sum_lanes4). Every (row, key) score is head_dot's
// whatever its place.
template <int R>
void tile_scores(const float* const* q, const float* kp, const int64_t* keys, int64_t n, int64_t D, float scale,
                 float* const* scores) {
  const __m128 factor = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *k0 = kp + keys[t], *k1 = kp + keys[t + 1], *k2 = kp + keys[t + 2], *k3 = kp + keys[t + 3];
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += HEAD_LANES) {
      const __m256 v0 = _mm256_loadu_ps(k0 + d), v1 = _mm256_loadu_ps(k1 + d);
      const __m256 v2 = _mm256_loadu_ps(k2 + d), v3 = _mm256_loadu_ps(k3 + d);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
        acc[r][0] = _mm256_fmadd_ps(qv, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qv, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qv, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) _mm_storeu_ps(scores[r] + t, _mm_mul_ps(sum_lanes4(acc[r]), factor));
  }
  for (; t < n; ++t)
    for (int r = 0; r < R; ++r) scores[r][t] = head_dot(q[r], kp + keys[t], D) * scale;
}

// The context's share of R rows' value sums (rows of one sequence and key-value head share its
// keys): out[r][d0 ... d0 + VLANES STEPS) = sum over t < n, in key order, of p[r][t] value t, not
// yet divided by l -- each value vector loaded once for the R rows, every output lane its own
// chain of fused multiply-adds in key order, held in registers, which finish_values continues
// over the row's own block keys. A lane's chain is the same whatever the vectors' width, so the
// AVX-512 build's 16 lanes sum exactly what 8 lanes do.
template <int R, int STEPS>
void context_values(const float* vp, const int64_t* keys, const float* const* p, int64_t n, int64_t d0, float* const* out) {
  Vec acc[R][STEPS];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < STEPS; ++s) acc[r][s] = vzero();
  for (int64_t t = 0; t < n; ++t) {
    const float* v = vp + keys[t] + d0;
    Vec w[R];
    for (int r = 0; r < R; ++r) w[r] = vsplat(p[r][t]);
    for (int s = 0; s < STEPS; ++s) {
      const Vec vs = vload(v + s * VLANES);
      for (int r = 0; r < R; ++r) acc[r][s] = vfmadd(w[r], vs, acc[r][s]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < STEPS; ++s) vstore(out[r] + d0 + s * VLANES, acc[r][s]);
}

// The same over 8 lanes: the last 8 of a head dimension that is an odd multiple of 8 (AVX-512).
template <int R>
void context_values8(const float* vp, const int64_t* keys, const float* const* p, int64_t n, int64_t d0, float* const* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 vs = _mm256_loadu_ps(vp + keys[t] + d0);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][t]), vs, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r] + d0, acc[r]);
}

// context_values over the whole head dimension, 4 vectors per row at a time.
template <int R>
void rows_context_values(const float* vp, const int64_t* keys, const float* const* p, int64_t n, int64_t D, float* const* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * VLANES <= D; d0 += 4 * VLANES) context_values<R, 4>(vp, keys, p, n, d0, out);
  for (; d0 + VLANES <= D; d0 += VLANES) context_values<R, 1>(vp, keys, p, n, d0, out);
  for (; d0 < D; d0 += HEAD_LANES) context_values8<R>(vp, keys, p, n, d0, out);
}

// A row's value sums continued from out (its context's share) over its n block keys, in block
// order, then divided by l; all of a row's vectors per key (independent chains). A row's result
// is the same whatever rows share its tile.
void finish_values(const float* vp, const int64_t* keys, const float* p, int64_t n, int64_t D, float l, float* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * VLANES <= D; d0 += 4 * VLANES) {
    Vec acc[4];
    for (int s = 0; s < 4; ++s) acc[s] = vload(out + d0 + s * VLANES);
    for (int64_t t = 0; t < n; ++t) {
      const Vec w = vsplat(p[t]);
      for (int s = 0; s < 4; ++s) acc[s] = vfmadd(w, vload(vp + keys[t] + d0 + s * VLANES), acc[s]);
    }
    const Vec sum = vsplat(l);
    for (int s = 0; s < 4; ++s) vstore(out + d0 + s * VLANES, vdiv(acc[s], sum));
  }
  const __m256 sum = _mm256_set1_ps(l);
  for (; d0 < D; d0 += HEAD_LANES) {
    __m256 acc = _mm256_loadu_ps(out + d0);
    for (int64_t t = 0; t < n; ++t) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vp + keys[t] + d0), acc);
    _mm256_storeu_ps(out + d0, _mm256_div_ps(acc, sum));
  }
}

// q [B, Hq, Q, D] float32; k, v: a layer's storage, any shape, float32 contiguous; offsets [B, S]
// int64: the element offset in k / v of position p's key for key-value head 0 of sequence b
// (key-value head g at + g * head_stride; query head h reads g = h / (Hq / kv_heads));
// lengths [B] int64; mask [B, Q, Q] bool; rows [B] int64 or none: sequence b's block rows past
// rows[b] are padding, not computed (their output is zero) -> [B, Hq, Q, D].
// packed (rows given): q holds the real rows alone, [N, Hq, D] with N = sum of rows (sequence b's
// rows after those of sequences 0 ... b - 1, workers.model.Packing's order) -> [N, Hq, D]: the
// forward need not lay its rows out padded and back at every layer (at 4 streams, 2-6 ms of a
// 63 ms verify of trees of unequal sizes). Each row's arithmetic is the padded layout's.
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                          int64_t kv_heads, int64_t head_stride, const at::Tensor& lengths, const at::Tensor& mask,
                          double scale, const std::optional<at::Tensor>& rows, bool packed) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "ddtree_cpu.tree_attention runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "tree_attention is float32");
  TORCH_CHECK(!packed || rows.has_value(), "packed queries need rows");
  const int64_t dims = packed ? 3 : 4;
  TORCH_CHECK(q.dim() == dims && q.size(dims - 1) % HEAD_LANES == 0 && q.size(dims - 1) <= 512,
              packed ? "packed q must be [N, Hq, D]" : "q must be [B, Hq, Q, D]", " with D a multiple of 8, at most 512");
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "query heads (", q.size(1), ") must be a multiple of kv_heads");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous storage");
  const int64_t B = packed ? offsets.size(0) : q.size(0), Hq = q.size(1), D = q.size(dims - 1);
  const int64_t Q = packed ? mask.size(1) : q.size(2);
  TORCH_CHECK(offsets.dim() == 2 && offsets.size(0) == B && offsets.scalar_type() == at::kLong, "offsets must be [B, S] int64");
  TORCH_CHECK(lengths.numel() == B && lengths.scalar_type() == at::kLong, "lengths must be [B] int64");
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == Q && mask.size(2) == Q && mask.scalar_type() == at::kBool,
              "mask must be [B, Q, Q] bool");
  const int64_t S = offsets.size(1);
  // packed queries are read in place where each row's heads lie contiguous (q split from the
  // rotated q and k of one op), not copied once more a layer
  at::Tensor qc = packed && q.stride(2) == 1 && q.stride(1) == D ? q : q.contiguous();
  at::Tensor oc = offsets.contiguous(), lc = lengths.contiguous(), mc = mask.contiguous();
  const int64_t q_row = packed ? qc.stride(0) : Hq * D;
  const int64_t* len = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + Q <= S, "sequence ", b, ": ", len[b], " + ", Q, " positions exceed the ", S, " offsets");
  std::vector<int64_t> real(B, Q);  // block rows computed per sequence
  if (rows.has_value()) {
    TORCH_CHECK(rows->numel() == B && rows->scalar_type() == at::kLong, "rows must be [B] int64");
    const at::Tensor rc = rows->contiguous();
    for (int64_t b = 0; b < B; ++b) {
      real[b] = rc.data_ptr<int64_t>()[b];
      TORCH_CHECK(real[b] >= 0 && real[b] <= Q, "sequence ", b, ": ", real[b], " rows of a ", Q, "-row block");
    }
  }
  std::vector<int64_t> start(B);  // packed: sequence b's first row
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    start[b] = total;
    total += real[b];
  }
  TORCH_CHECK(!packed || total == q.size(0), "packed q has ", q.size(0), " rows; rows sum to ", total);
  at::Tensor out = packed ? at::empty({q.size(0), Hq, D}, q.options())
                          : rows.has_value() ? at::zeros({B, Hq, Q, D}, q.options()) : at::empty({B, Hq, Q, D}, q.options());
  // where row i of sequence b, query head h, lies in out, and in q
  auto at_row = [&](int64_t b, int64_t h, int64_t i) { return packed ? ((start[b] + i) * Hq + h) * D : ((b * Hq + h) * Q + i) * D; };
  auto q_at = [&](int64_t b, int64_t h, int64_t i) { return packed ? (start[b] + i) * q_row + h * D : at_row(b, h, i); };
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t* off = oc.data_ptr<int64_t>();
  const bool* mp = mc.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t per_kv = Hq / kv_heads;
  const float sc = static_cast<float>(scale);
  // work items: up to TILE_ROWS query rows of one sequence that share a key-value head (so its
  // context keys), scored against those keys together
  constexpr int64_t TILE_ROWS = 3;
  const int64_t group_rows = per_kv * Q, tiles = (group_rows + TILE_ROWS - 1) / TILE_ROWS;
  // the tiles that hold real rows, (b * kv_heads + g) * tiles + tile, split evenly between the
  // threads: split over every tile of the padded width, a step of one 17-row tree and three
  // 1-row ones gave one thread 54 of the 60 real tiles (SmolLM2's heads at 300 positions: 221 us
  // a call, 157 balanced; four 5-row trees 115-126)
  std::vector<int64_t> work;
  work.reserve(B * kv_heads * tiles);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t tile = 0; tile * TILE_ROWS < per_kv * real[b]; ++tile) work.push_back((b * kv_heads + g) * tiles + tile);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(TILE_ROWS * (S + HEAD_LANES));
    std::vector<int64_t> keys(S), block_keys(TILE_ROWS * Q);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t item = work[index];
      const int64_t b = item / (kv_heads * tiles), g = (item / tiles) % kv_heads, tile = item % tiles;
      const int64_t head = g * head_stride, context = len[b], nb = real[b];
      // this sequence's rows: query head g * per_kv + r / nb, block row r % nb, for r < per_kv * nb
      const int64_t first = tile * TILE_ROWS, rows = std::min(TILE_ROWS, per_kv * nb - first);  // >= 1: a real tile
      const float* qrows[TILE_ROWS];
      float* scores[TILE_ROWS];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = g * per_kv + (first + r) / nb, i = (first + r) % nb;
        qrows[r] = qp + q_at(b, h, i);
        scores[r] = buffer.data() + r * (S + HEAD_LANES);
      }
      for (int64_t p = 0; p < context; ++p) keys[p] = off[b * S + p] + head;
      switch (rows) {
        case 3: tile_scores<3>(qrows, kp, keys.data(), context, D, sc, scores); break;
        case 2: tile_scores<2>(qrows, kp, keys.data(), context, D, sc, scores); break;
        default: tile_scores<1>(qrows, kp, keys.data(), context, D, sc, scores); break;
      }
      float* outs[TILE_ROWS];
      float totals[TILE_ROWS];
      int64_t seen[TILE_ROWS];  // block keys each row sees
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = g * per_kv + (first + r) / nb, i = (first + r) % nb;
        outs[r] = op + at_row(b, h, i);
        float* sp = scores[r];
        int64_t* own = block_keys.data() + r * Q;
        seen[r] = 0;  // then the block keys this row sees, in block order
        for (int64_t j = 0; j < Q; ++j)
          if (mp[(b * Q + i) * Q + j]) own[seen[r]++] = off[b * S + context + j] + head;
        float* tail = sp + context;
        tile_scores<1>(&qrows[r], kp, own, seen[r], D, sc, &tail);
        const int64_t n = context + seen[r];
        __m256 top = _mm256_set1_ps(-INFINITY);  // the maximum, any order (exact)
        int64_t t = 0;
        for (; t + HEAD_LANES <= n; t += HEAD_LANES) top = _mm256_max_ps(top, _mm256_loadu_ps(sp + t));
        alignas(32) float lanes[HEAD_LANES];
        _mm256_store_ps(lanes, top);
        float m = lanes[0];
        for (int64_t j = 1; j < HEAD_LANES; ++j) m = std::max(m, lanes[j]);
        for (; t < n; ++t) m = std::max(m, sp[t]);
        for (t = 0; t < n; ++t) sp[t] -= m;
        expf_lanes(sp, n);
        // l: lane j sums the p_t with t = j mod 8 in key order (the tail padded with zeros), then sum_lanes
        const int64_t padded = (n + HEAD_LANES - 1) / HEAD_LANES * HEAD_LANES;
        for (t = n; t < padded; ++t) sp[t] = 0.0f;
        __m256 total = _mm256_setzero_ps();
        for (t = 0; t < padded; t += HEAD_LANES) total = _mm256_add_ps(total, _mm256_loadu_ps(sp + t));
        totals[r] = sum_lanes(total);
      }
      // out = (sum over the keys in order of p_t value t) / l: the shared context keys for the
      // tile's rows together, then each row's own block keys
      switch (rows) {
        case 3: rows_context_values<3>(vp, keys.data(), scores, context, D, outs); break;
        case 2: rows_context_values<2>(vp, keys.data(), scores, context, D, outs); break;
        default: rows_context_values<1>(vp, keys.data(), scores, context, D, outs); break;
      }
      for (int64_t r = 0; r < rows; ++r)
        finish_values(vp, block_keys.data() + r * Q, scores[r] + context, seen[r], D, totals[r], outs[r]);
    }
  });
  return out;
}

#else
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                          int64_t kv_heads, int64_t head_stride, const at::Tensor& lengths, const at::Tensor& mask,
                          double scale, const std::optional<at::Tensor>& rows, bool packed) {
  TORCH_CHECK(false, "ddtree_cpu.tree_attention is built for AVX2 CPUs (torch's SDPA serves elsewhere)");
}
#endif

// --- row-wise ops -------------------------------------------------------------------------------
//
// The few elementwise and per-row steps between a layer's GEMMs, one op each where torch takes
// several: at the few rows of decoding each op's first call after a GEMM costs ~20-80 us on
// this 2-core machine whatever its size (torch.rms_norm at 9 rows: 82 us right after a linear,
// 11 us when repeated; its composite runs five ops), so a layer's norm, residual and gating cost
// more than its arithmetic. Every row is computed by the same fixed order of operations whatever
// the number of rows and threads (batch invariance, as float_mm): a tree's verify row gets
// bitwise what plain decoding of the same token gets.
//
//   rms_norm      x [M, D], w [D] -> x * w / sqrt(mean(x^2) + eps); the sum of squares in 8
//                 partial sums (element i into sum i mod 8, in increasing i), then added in one
//                 fixed tree
//   add_rms_norm  x, r [M, D] -> (x + r, rms_norm(x + r)): a residual add and the next norm
//   silu_mul      gate, up [M, I] -> silu(gate) * up, with silu(g) = g / (1 + exp(-g)) from
//                 expf_lanes (exp of -|g|, so never above 1)
//   rope_qk       q [M, Hq, D], k [M, Hkv, D], cos, sin [M, D] -> [M, Hq + Hkv, D]: both rotated
//                 (workers.model.apply_rope, rotate-half) into one tensor, as cat + rope did

inline float row_inverse_rms(const float* x, int64_t D, float eps) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[i + j] * x[i + j];
  for (int j = 0; i < D; ++i, ++j) part[j] += x[i] * x[i];
  const float sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
  return 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
}

// o = a * w / sqrt(mean(a^2) + eps), one row of D
inline void normalize_row(const float* a, const float* w, int64_t D, float eps, float* o) {
  const float inv = row_inverse_rms(a, D, eps);
  for (int64_t i = 0; i < D; ++i) o[i] = a[i] * inv * w[i];
}

void check_rows(const at::Tensor& t, const char* name, int64_t D) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "ddtree_cpu: ", name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == D, "ddtree_cpu: ", name, " has ", t.size(-1), " columns, expected ", D);
}

// rows of at most this many run on the calling thread (a decode step's); more split over threads by rows
constexpr int64_t ROW_GRAIN = 256;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t D = w.numel();
  check_rows(x, "x", D);
  check_rows(w, "w", D);
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float *px = xc.data_ptr<float>(), *pw = wc.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, D ? xc.numel() / D : 0, ROW_GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) normalize_row(px + r * D, pw, D, e, po + r * D);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps) {
  const int64_t D = w.numel();
  check_rows(x, "x", D);
  check_rows(r, "r", D);
  check_rows(w, "w", D);
  TORCH_CHECK(x.sizes() == r.sizes(), "ddtree_cpu.add_rms_norm: x and r differ in shape");
  at::Tensor xc = x.contiguous(), rc = r.contiguous(), wc = w.contiguous();
  at::Tensor sum = at::empty_like(xc), out = at::empty_like(xc);
  const float *px = xc.data_ptr<float>(), *pr = rc.data_ptr<float>(), *pw = wc.data_ptr<float>();
  float *ps = sum.data_ptr<float>(), *po = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, D ? xc.numel() / D : 0, ROW_GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      float* s = ps + row * D;
      for (int64_t i = 0; i < D; ++i) s[i] = px[row * D + i] + pr[row * D + i];
      normalize_row(s, pw, D, e, po + row * D);
    }
  });
  return {sum, out};
}

at::Tensor rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim() && q.size(-1) % 2 == 0,
              "ddtree_cpu.rope_qk: q, k [..., heads, D] with D even");
  const int64_t D = q.size(-1), Hq = q.size(-2), Hk = k.size(-2), half = D / 2;
  check_rows(q, "q", D);
  check_rows(k, "k", D);
  check_rows(cos, "cos", D);
  check_rows(sin, "sin", D);
  // [M, H, D] views where the rows allow (q and k split from one fused GEMM's output), else copies
  at::Tensor qv = q.reshape({-1, Hq, D}), kv = k.reshape({-1, Hk, D});
  at::Tensor cv = cos.reshape({-1, D}), sv = sin.reshape({-1, D});
  if (qv.stride(2) != 1 || qv.stride(1) != D) qv = qv.contiguous();
  if (kv.stride(2) != 1 || kv.stride(1) != D) kv = kv.contiguous();
  if (cv.stride(1) != 1) cv = cv.contiguous();
  if (sv.stride(1) != 1) sv = sv.contiguous();
  const int64_t M = qv.size(0);
  TORCH_CHECK(kv.size(0) == M && cv.size(0) == M && sv.size(0) == M, "ddtree_cpu.rope_qk: q, k, cos and sin differ in rows");
  at::Tensor out = at::empty({M, Hq + Hk, D}, qv.options());
  const float *pq = qv.data_ptr<float>(), *pk = kv.data_ptr<float>(), *pc = cv.data_ptr<float>(), *ps = sv.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t qs = qv.stride(0), ks = kv.stride(0), cs = cv.stride(0), ss = sv.stride(0);
  at::parallel_for(0, M, ROW_GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float *c = pc + r * cs, *s = ps + r * ss;
      for (int64_t h = 0; h < Hq + Hk; ++h) {
        const float* x = h < Hq ? pq + r * qs + h * D : pk + r * ks + (h - Hq) * D;
        float* o = po + (r * (Hq + Hk) + h) * D;
        for (int64_t j = 0; j < half; ++j) o[j] = x[j] * c[j] - x[j + half] * s[j];
        for (int64_t j = half; j < D; ++j) o[j] = x[j] * c[j] + x[j - half] * s[j];
      }
    }
  });
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape[shape.size() - 2] = Hq + Hk;
  return out.view(shape);
}

#ifdef __AVX2__
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t I = gate.size(-1);
  check_rows(gate, "gate", I);
  check_rows(up, "up", I);
  TORCH_CHECK(gate.sizes() == up.sizes(), "ddtree_cpu.silu_mul: gate and up differ in shape");
  // [M, I] views where the rows allow (gate and up split from one fused GEMM's output), else copies
  at::Tensor g = gate.reshape({-1, I}), u = up.reshape({-1, I});
  if (g.stride(1) != 1) g = g.contiguous();
  if (u.stride(1) != 1) u = u.contiguous();
  const int64_t M = g.size(0), gs = g.stride(0), us = u.stride(0);
  at::Tensor out = at::empty({M, I}, g.options());
  const float *pg = g.data_ptr<float>(), *pu = u.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, M, ROW_GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float *a = pg + r * gs, *b = pu + r * us;
      float* o = po + r * I;
      for (int64_t i = 0; i < I; ++i) o[i] = -std::fabs(a[i]);
      expf_lanes(o, I);  // e = exp(-|g|)
      for (int64_t i = 0; i < I; ++i) {
        const float e = o[i], sigmoid = a[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        o[i] = a[i] * sigmoid * b[i];
      }
    }
  });
  return out.view(gate.sizes());
}
#else
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(false, "ddtree_cpu.silu_mul is built for AVX2 CPUs (torch's silu serves elsewhere)");
}
#endif

// --- the FMA rate ---------------------------------------------------------------------------------
//
// fma_rate: multiply-adds per second that the calling thread retires in float_mm's vectors (16
// lanes with AVX-512, else 8) when nothing waits on memory -- twelve independent chains of fused
// multiply-adds. The compute floor of a forward of q rows is q times its multiply-adds over this
// rate times the threads (benchmarks/verify_cost.py prints it beside T(q)).
double fma_rate(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "iterations must be positive");
#if defined(__AVX2__)
  Vec a[12];
  const Vec x = vsplat(0.999999f), y = vsplat(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = vsplat(static_cast<float>(i));
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iterations; ++n)
    for (int i = 0; i < 12; ++i) a[i] = vfmadd(a[i], x, y);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink = 0.0f;  // the chains' results are used, so the loop stays
  for (int i = 0; i < 12; ++i) sink += sum_lanes(a[i]);
  TORCH_CHECK(std::isfinite(sink), "fma_rate: the chains overflowed");
  return 12.0 * static_cast<double>(VLANES) * static_cast<double>(iterations) / seconds;
#else
  TORCH_CHECK(false, "ddtree_cpu.fma_rate measures AVX2 or AVX-512 fused multiply-adds");
#endif
}

}  // namespace

TORCH_LIBRARY(ddtree_cpu, m) {
  m.def("blocks_mm(Tensor x, Tensor blocks, str kind) -> Tensor");
  m.impl("blocks_mm", c10::DispatchKey::CPU, TORCH_FN(blocks_mm));
  m.def("float_mm(Tensor x, Tensor w) -> Tensor");
  m.impl("float_mm", c10::DispatchKey::CPU, TORCH_FN(float_mm));
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor offsets, int kv_heads, int head_stride, Tensor lengths, "
        "Tensor mask, float scale, Tensor? rows=None, bool packed=False) -> Tensor");
  m.impl("tree_attention", c10::DispatchKey::CPU, TORCH_FN(tree_attention));
  m.def("fma_rate(int iterations) -> float", TORCH_FN(fma_rate));
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rope_qk", c10::DispatchKey::CPU, TORCH_FN(rope_qk));
}
