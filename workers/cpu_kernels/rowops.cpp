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

#include "common.h"
#include "ops.h"

namespace ddtree_cpu {
namespace {

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

}  // namespace

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

}  // namespace ddtree_cpu
