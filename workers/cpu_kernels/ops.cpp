// torch.ops.ddtree_cpu.*: the schema of every op of ddtree's CPU kernels and its CPU implementation
// (gemm.cpp, attention.cpp, rowops.cpp), registered when the library loads (workers/cpu_kernels,
// load_kernels).

#include <torch/library.h>

#include "ops.h"

using namespace ddtree_cpu;

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
