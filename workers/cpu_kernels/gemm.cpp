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
// blocks_mm: each thread takes a share of the output columns (W's rows), TILE_N at a time, and
// decodes them PASS_COLUMNS columns at a time over the whole of K into an fp32 buffer (exactly as
// gguf.quants de-quantizes them: an fp16 scale times a small integer code is exact in fp32);
// every activation row, up to PANEL_M of them, is multiplied against that buffer in register
// tiles of up to PASS_ROWS rows x PASS_COLUMNS columns whose sums stay in registers from the
// first input to the last; so a weight is read from memory and decoded once per PANEL_M rows,
// not once per few rows. Up to 5 rows (8 with AVX-512: plain decoding, a small
// tree's verify pass, a drafter's first depths) skip the buffer: each block is decoded in
// registers and used at once for every row. Its result is F.linear over the de-quantized weights
// up to the order of the float sums. With AVX-512 (SmolLM2's Q4_1 layers and Q8_0 head, 2 cores):
// 0.83x the AVX2 build's time at 5 rows, 0.8x at 6-8, 0.84x at 9-17, the same at one row.
//
// Every multiply-add of a vector of weights is one row's: the decode of a block is paid once per
// call, whatever M, and at 5-17 rows its vector operations are a large share of the work (with
// AVX-512 they issue on the same two ports as the multiply-adds). So the decodes are kept short:
// a block's fp16 scales come from one broadcast load and one conversion (half_pair), and with
// AVX-512 a 4-bit block's 16 possible weights are computed once and picked by a permute
// (lookup_nibbles); the sums' lanes are added 16 outputs at a time (lane_sums). Against a
// scalar conversion and register broadcast per scale, a widen-convert-multiply-add per 16
// weights and one lane sum at a time (benchmarks/native_ab.py: one SmolLM2 layer's Q4_1
// matrices, one thread, cache-resident, on a busy 2-core AVX-512 machine, so a direction only):
// AVX-512 0.79x the time at 5 rows, 0.88x at 9, 0.91x at 17; AVX2 0.95x at 9, the same at 5
// and 17. Q8_0 (the 8-bit codes have no short table) is about unchanged.
//
// float_mm: see its section below.
//
// fma_rate (the FMA floor the benchmarks compare against) lives here too: it runs in float_mm's
// vectors.

#include "common.h"
#include "ops.h"

namespace ddtree_cpu {
namespace {

constexpr int64_t GROUP = 32;    // weights per GGUF block
constexpr int64_t TILE_N = 12;   // output columns per task step (PASS_COLUMNS divides it)
constexpr int64_t PANEL_M = 64;  // activation rows multiplied per decoded tile
#ifdef __AVX512F__
constexpr int PASS_COLUMNS = 6;  // decoded columns a register tile of multiply_pass spans
#else
constexpr int PASS_COLUMNS = 3;
#endif
constexpr int64_t PASS_ROWS = 4;  // rows a register tile holds at most

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

// y[r * N + c] = the lanes of a[r][c] summed (sum_lanes' tree), for the first `columns` of C
// columns; a's entries are vectors, or LANES floats in the build without AVX2.
template <int R, int C, typename Sums>
inline void store_sums(const Sums (&a)[R][C], float* y, int64_t N, int64_t columns) {
#ifdef __AVX512F__
  float sums[R][C];
  lane_sums<R * C>(&a[0][0], &sums[0][0]);
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < columns; ++c) y[r * N + c] = sums[r][c];
#else
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < columns; ++c) y[r * N + c] = sum_lanes(a[r][c]);
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
// (eight bytes widened from memory at a time, then masked or shifted)
inline void nibbles(const uint8_t* q, __m256 c[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
    c[h] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask));
    c[h + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
}

// The fp16 values at b and b + 2 (a block's d, and m where it has one), each in all lanes: the
// four bytes broadcast by a load, one conversion for both and two in-lane duplications, instead
// of a conversion and a broadcast from a register each (the same conversion: the same floats)
inline void half_pair(const uint8_t* b, __m256& first, __m256& second) {
  const __m256 pairs = _mm256_cvtph_ps(_mm_castps_si128(_mm_broadcast_ss(reinterpret_cast<const float*>(b))));
  first = _mm256_moveldup_ps(pairs);
  second = _mm256_movehdup_ps(pairs);
}

// A block's weights as four vectors of eight (inputs 0-7, 8-15, 16-23, 24-31).
inline void decode(Q4_0, const uint8_t* b, __m256 w[4]) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  __m256 d, unused;
  half_pair(b, d, unused);
  nibbles(b + 2, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_sub_ps(w[i], eight));  // q - 8 is exact
}

inline void decode(Q4_1, const uint8_t* b, __m256 w[4]) {
  __m256 d, m;
  half_pair(b, d, m);
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

#ifdef __AVX512F__
// A block of 4-bit codes takes only 16 values, table[q] = scale q + offset (as the AVX2 decode
// computes each weight: one rounding); a permute picks them (its index's low 4 bits, so a code
// byte widened to 32 bits gives its low nibble as it is): two ALU operations per 16 weights fewer
// than a widening, a conversion and a multiply-add each, on the two ports the FMAs use.
inline __m512 code_values(__m512 scale, __m512 offset) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(scale, codes, offset);
}

// 16 bytes of 4-bit codes -> the weights of codes 0-15 (low nibbles), 16-31 (high nibbles)
inline void lookup_nibbles(const uint8_t* q, __m512 table, __m512 w[2]) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  w[0] = _mm512_permutexvar_ps(bytes, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

// half_pair in all 16 lanes
inline void half_pair(const uint8_t* b, __m512& first, __m512& second) {
  const __m256i both = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(b)));
  const __m512 pairs = _mm512_cvtph_ps(both);  // first, second, first, second, ...
  first = _mm512_moveldup_ps(pairs);
  second = _mm512_movehdup_ps(pairs);
}

// A block's weights as two vectors of sixteen (inputs 0-15, 16-31): the same values as the
// AVX2 decode's, element by element.
inline void decode(Q4_0, const uint8_t* b, __m512 w[2]) {
  const __m512 centered = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);  // q - 8, exact
  __m512 d, unused;
  half_pair(b, d, unused);
  lookup_nibbles(b + 2, _mm512_mul_ps(d, centered), w);
}

inline void decode(Q4_1, const uint8_t* b, __m512 w[2]) {
  __m512 d, m;
  half_pair(b, d, m);
  lookup_nibbles(b + 4, code_values(d, m), w);
}

inline void decode(Q8_0, const uint8_t* b, __m512 w[2]) {
  __m512 d, unused;
  half_pair(b, d, unused);
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

// Q4_K's group j by its table (lookup_nibbles): the low (j even) or high nibbles of 32 bytes
inline void decode(Q4_K, const uint8_t* b, int j, __m512 w[2]) {
  float scale[2], offset[2];
  group_affine(Q4_K{}, b, j, scale, offset);
  const __m512 table = code_values(_mm512_set1_ps(scale[0]), _mm512_set1_ps(offset[0]));
  const uint8_t* q = b + 16 + 32 * (j / 2);
  const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1));
  for (int h = 0; h < 2; ++h)
    w[h] = _mm512_permutexvar_ps(_mm512_srl_epi32(_mm512_cvtepu8_epi32(load16(q + 16 * h)), shift), table);
}

inline void decode(Q5_0, const uint8_t* b, __m512 w[2]) { decode(Q5_0{}, b, 0, w); }
inline void decode(Q5_1, const uint8_t* b, __m512 w[2]) { decode(Q5_1{}, b, 0, w); }
#endif
constexpr int BLOCK_VECTORS = GROUP / VLANES;  // a decoded block's vectors

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

// R activation rows (1-5, or 1-8 with AVX-512: plain decoding, a verify pass over a small tree,
// a drafter's first depths) times C weight rows, each block decoded in registers once and used
// at once for all R rows: the buffer of `tiles` pays for its stores and loads only when more rows
// share a decoded block. The same sums as multiply_pass's, lane j adding k = j, j + VLANES, ...
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
  store_sums(a, y, N, C);
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

#endif

#ifdef __AVX2__
// v stays in a register from here on: without it GCC folds a weight vector's load into each of
// its R multiply-adds (R * C + R loads a step instead of R + C, more than the two load ports give)
inline void in_register(Vec& v) { asm("" : "+v"(v)); }
#endif

// y[r, c] (row stride N) for R rows of x (row stride K) against the PASS_COLUMNS decoded weight
// columns of w [column][K] (only the first `columns` stored): the R x PASS_COLUMNS sums stay in
// registers over the whole of K, each step of VLANES inputs loading PASS_COLUMNS weight vectors
// and R activation vectors for R * PASS_COLUMNS fused multiply-adds. Not inlined: inside tiles'
// loops GCC kept the AVX2 build's 12 sums on the stack.
template <int R>
__attribute__((noinline)) void multiply_pass(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t columns) {
  constexpr int C = PASS_COLUMNS;
#ifdef __AVX2__
  Vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = vzero();
  for (int64_t k = 0; k < K; k += VLANES) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = vload_aligned(w + c * K + k);
      in_register(wv[c]);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * K + k);
      for (int c = 0; c < C; ++c) a[r][c] = vfmadd(wv[c], xv, a[r][c]);
    }
  }
#else
  alignas(32) float a[R][C][LANES] = {};
  for (int64_t k = 0; k < K; k += LANES)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < LANES; ++j) a[r][c][j] += w[c * K + k + j] * x[r * K + k + j];
#endif
  store_sums(a, y, N, columns);
}

// Output columns of tiles [t0, t1) of y [M, N] from x [M, K] and W's blocks [N, K / 32, BYTES]:
// PASS_COLUMNS columns at a time are decoded over the whole of K into a buffer (zeros past N),
// then the rows pass over it in groups of as even a size as PASS_ROWS allows, each group's sums
// held in registers from the first input to the last (multiply_pass).
template <typename Block>
void tiles(const float* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t groups = K / GROUP, stride = row_bytes<Block>(groups);
  std::vector<float> storage(PASS_COLUMNS * K + 16);  // decoded weights [column][input], 64-byte aligned
  float* w = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / sizeof(float) % 16) % 16;
  const int64_t n1 = std::min(N, t1 * TILE_N);
  const int64_t panels = (M + PANEL_M - 1) / PANEL_M;  // of as even a size as PANEL_M allows (65 rows: 33 + 32)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t m0 = M * p / panels, rows = M * (p + 1) / panels - m0;
    const int64_t parts = (rows + PASS_ROWS - 1) / PASS_ROWS;
    for (int64_t n0 = t0 * TILE_N; n0 < n1; n0 += PASS_COLUMNS) {
      const int64_t columns = std::min<int64_t>(PASS_COLUMNS, n1 - n0);
      for (int64_t c = 0; c < columns; ++c) {
        const uint8_t* row = blocks + (n0 + c) * stride;
        for (int64_t g = 0; g < groups; ++g) {
          // the next pass's block (see few_rows)
          prefetch(row + PASS_COLUMNS * stride + g * Block::BYTES * GROUP / Block::VALUES);
          decode_block(Block{}, row, g, w + c * K + g * GROUP);
        }
      }
      std::fill(w + columns * K, w + PASS_COLUMNS * K, 0.0f);
      int64_t m = m0;
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t r = (m0 + rows - m) / (parts - part);
        const float* xs = x + m * K;
        float* ys = y + m * N + n0;
        switch (r) {
          case 4: multiply_pass<4>(xs, K, w, ys, N, columns); break;
          case 3: multiply_pass<3>(xs, K, w, ys, N, columns); break;
          case 2: multiply_pass<2>(xs, K, w, ys, N, columns); break;
          default: multiply_pass<1>(xs, K, w, ys, N, columns); break;
        }
        m += r;
      }
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

}  // namespace

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

namespace {

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
// order than the AVX2 build's; workers.cpu_kernels.kernel_key names the build). Up to 9 rows pass over a
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

}  // namespace

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

}  // namespace ddtree_cpu
