// Route B: opsmith's ops in the PyTorch dispatcher (torch.ops.opsmith.*).
// Each schema is defined once; its CPU and CUDA kernels are registered
// right after it. The fake (meta) kernels and autograd live in
// opsmith/ops.py, which set_python_module names so the dispatcher can
// import it when this library is loaded on its own.
#include <torch/library.h>

#include "bridge.h"

TORCH_LIBRARY(opsmith, m) {
    m.set_python_module("opsmith.ops");
    m.def("rms_norm_fwd(Tensor x, Tensor? weight, float? eps=None) -> (Tensor y, Tensor inv_rms)");
    m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor inv_rms) -> (Tensor dx, Tensor dweight)");
}

TORCH_LIBRARY_IMPL(opsmith, CPU, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd);
}

#if OPSMITH_WITH_CUDA
TORCH_LIBRARY_IMPL(opsmith, CUDA, m) {
    m.impl("rms_norm_fwd", &opsmith::rms_norm_fwd);
    m.impl("rms_norm_bwd", &opsmith::rms_norm_bwd);
}
#endif
