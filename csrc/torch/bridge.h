// The torch bridge: ATen tensors in, C ABI calls, ATen tensors out.
// Each function checks its arguments (messages name the argument), takes a
// device guard and the current stream, allocates the outputs and calls the
// CPU or CUDA launcher. Route B (ops.cpp) registers these functions with the
// dispatcher; route A (pybind.cpp) exposes the same functions to Python.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace opsmith {

// y, inv_rms = rms_norm_fwd(x, weight, eps): RMSNorm over the last dim of x.
// inv_rms has shape x.shape[:-1], float32 (float64 for float64 x).
// eps defaults to torch.finfo(x.dtype).eps, as torch.nn.functional.rms_norm.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor &x,
                                                const std::optional<at::Tensor> &weight,
                                                std::optional<double> eps);

// dx, dweight = rms_norm_bwd(dy, x, weight, inv_rms); dweight has shape [0]
// when weight is None.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor &dy, const at::Tensor &x,
                                                const std::optional<at::Tensor> &weight,
                                                const at::Tensor &inv_rms);

} // namespace opsmith
