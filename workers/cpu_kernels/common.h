// What the three families of ddtree's CPU kernels share (gemm.cpp, attention.cpp, rowops.cpp):
// the vectors they are written in, the fixed tree that adds a vector's lanes, and the softmax's
// and gating's exp. Each kernel file includes it into its own anonymous namespace's copy.

#pragma once

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

namespace ddtree_cpu {
namespace {

constexpr int64_t LANES = 8;     // partial sums per output (AVX2, and the scalar code)
#ifdef __AVX512F__
constexpr int64_t VLANES = 16;   // partial sums per output: the vectors' lanes
#else
constexpr int64_t VLANES = LANES;
#endif

#ifdef __AVX2__
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

// VLANES partial sums at a (aligned to the vector)
inline float sum_lanes(const float* a) { return sum_lanes(vload_aligned(a)); }

constexpr int64_t HEAD_LANES = 8;  // exp's and tree attention's lanes over a head

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
#else
inline float sum_lanes(const float* a) {  // the AVX2 tree, in scalar code
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}
#endif

}  // namespace
}  // namespace ddtree_cpu
