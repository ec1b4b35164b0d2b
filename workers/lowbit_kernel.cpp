// y = x W^T with W kept as GGUF blocks (Q4_0, Q4_1, Q8_0), fp32 activations and outputs.
//
// Each block of 32 weights is decoded to fp32 exactly as gguf.quants de-quantizes it (an fp16
// scale times a small integer code is exact in fp32, so a fused multiply-add gives the same
// weight), then multiplied into every activation row while it sits in registers. The result is
// F.linear over the de-quantized weights up to the order of the float sums, which is fixed:
// each output is one thread's sum in the same order whatever the thread count (with AVX2: two
// 8-lane accumulators over the blocks, then the 16 lanes in a fixed tree). AVX2 rows are taken
// four at a time per pass over a weight row: a tree's rows read each weight from memory once.
//
// Built and loaded by workers/quantized.py (build_kernel); the op is torch.ops.ddtree_lowbit.mm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 4;  // activation rows multiplied per pass over a weight row

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Each block type decodes its 32 weights into w[0..31], in the order of their columns:
// scalar code everywhere, and with AVX2 the same values as four vectors of eight.
struct Q4_0 {
  static constexpr int64_t BYTES = 18;  // fp16 d, 16 bytes of codes: w = d (q - 8)
  static inline void decode(const uint8_t* b, float* w) {
    const float d = half_at(b);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((b[2 + j] & 0x0F) - 8);
      w[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
    }
  }
};

struct Q4_1 {
  static constexpr int64_t BYTES = 20;  // fp16 d, fp16 m, 16 bytes of codes: w = d q + m
  static inline void decode(const uint8_t* b, float* w) {
    const float d = half_at(b), m = half_at(b + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(b[4 + j] & 0x0F) + m;
      w[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
    }
  }
};

struct Q8_0 {
  static constexpr int64_t BYTES = 34;  // fp16 d, 32 int8 codes: w = d q
  static inline void decode(const uint8_t* b, float* w) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
  }
};

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

inline void decode_avx2(Q4_0, const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b)), eight = _mm256_set1_ps(8.0f);
  nibbles(b + 2, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_sub_ps(w[i], eight));  // q - 8 is exact
}

inline void decode_avx2(Q4_1, const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
  nibbles(b + 4, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, w[i], m);  // d q is exact: one rounding, as d q + m
}

inline void decode_avx2(Q8_0, const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
    w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
}

inline float sum_lanes(__m256 a, __m256 b) {  // a fixed order over the 16 lanes
  const __m256 s = _mm256_add_ps(a, b);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// y[m, n] for rows m of one tile (R <= TILE rows): two accumulators per row (columns 0-7 and
// 16-23 of each block into one, 8-15 and 24-31 into the other), added at the end.
template <typename Block, int R>
inline void tile(const float* x, int64_t K, const uint8_t* row, int64_t groups, float* y, int64_t N) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t g = 0; g < groups; ++g) {
    decode_avx2(Block{}, row + g * Block::BYTES, w);
    for (int r = 0; r < R; ++r) {
      const float* xs = x + r * K + g * GROUP;
      acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xs), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xs + 8), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xs + 16), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xs + 24), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = sum_lanes(acc[r][0], acc[r][1]);
}

// Output columns [n0, n1) of y [M, N] from x [M, K] and W's blocks [N, K / 32, BYTES].
template <typename Block>
void columns(const float* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t groups = K / GROUP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * groups * Block::BYTES;
    int64_t m = 0;
    for (; m + TILE <= M; m += TILE) tile<Block, TILE>(x + m * K, K, row, groups, y + m * N + n, N);
    switch (M - m) {
      case 3: tile<Block, 3>(x + m * K, K, row, groups, y + m * N + n, N); break;
      case 2: tile<Block, 2>(x + m * K, K, row, groups, y + m * N + n, N); break;
      case 1: tile<Block, 1>(x + m * K, K, row, groups, y + m * N + n, N); break;
    }
  }
}
#else
inline float sum_lanes(const float* a) {  // a fixed pairwise order over 32 lanes
  float s[16];
  for (int j = 0; j < 16; ++j) s[j] = a[j] + a[j + 16];
  for (int j = 0; j < 8; ++j) s[j] += s[j + 8];
  for (int j = 0; j < 4; ++j) s[j] += s[j + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// Output columns [n0, n1) of y [M, N] from x [M, K] and W's blocks [N, K / 32, BYTES]:
// lane j of a row's 32 accumulators sums the blocks' column j.
template <typename Block>
void columns(const float* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t groups = K / GROUP;
  std::vector<float> acc(M * GROUP);
  float w[GROUP];
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const uint8_t* row = blocks + n * groups * Block::BYTES;
    for (int64_t g = 0; g < groups; ++g) {
      Block::decode(row + g * Block::BYTES, w);
      for (int64_t m = 0; m < M; ++m) {
        const float* xs = x + m * K + g * GROUP;
        float* a = acc.data() + m * GROUP;
        for (int j = 0; j < GROUP; ++j) a[j] += w[j] * xs[j];
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = sum_lanes(acc.data() + m * GROUP);
  }
}
#endif

template <typename Block>
void run(const float* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K) {
  // about 64 KiB of weights per task, so small matrices stay on one thread
  const int64_t grain = std::max<int64_t>(1, 65536 / ((K / GROUP) * Block::BYTES));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { columns<Block>(x, blocks, y, M, N, K, n0, n1); });
}

// x [M, K] float32, blocks [N, K / 32, bytes per block] uint8 -> [M, N] float32
at::Tensor mm(const at::Tensor& x, const at::Tensor& blocks, const std::string& kind) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "ddtree_lowbit.mm runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be a [M, K] float32 tensor");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3, "blocks must be [N, K / 32, bytes] uint8");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(blocks.size(1) * GROUP == K, "blocks cover ", blocks.size(1) * GROUP, " inputs, x has ", K);
  at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t bytes = blocks.size(2);
  if (kind == "Q4_0" && bytes == Q4_0::BYTES) {
    run<Q4_0>(xp, bp, yp, M, N, K);
  } else if (kind == "Q4_1" && bytes == Q4_1::BYTES) {
    run<Q4_1>(xp, bp, yp, M, N, K);
  } else if (kind == "Q8_0" && bytes == Q8_0::BYTES) {
    run<Q8_0>(xp, bp, yp, M, N, K);
  } else {
    TORCH_CHECK(false, "unsupported block type ", kind, " with ", bytes, " bytes per block");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(ddtree_lowbit, m) {
  m.def("mm(Tensor x, Tensor blocks, str kind) -> Tensor");
  m.impl("mm", c10::DispatchKey::CPU, TORCH_FN(mm));
}
