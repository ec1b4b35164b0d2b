// The ops of ddtree's CPU kernels, as ops.cpp registers them (torch.ops.ddtree_cpu.*); each family's
// file says what its ops compute and in which order of float operations.

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace ddtree_cpu {

// gemm.cpp
at::Tensor blocks_mm(const at::Tensor& x, const at::Tensor& blocks, const std::string& kind);
at::Tensor float_mm(const at::Tensor& x, const at::Tensor& w);
double fma_rate(int64_t iterations);

// attention.cpp
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                          int64_t kv_heads, int64_t head_stride, const at::Tensor& lengths, const at::Tensor& mask,
                          double scale, const std::optional<at::Tensor>& rows, bool packed);

// rowops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace ddtree_cpu
