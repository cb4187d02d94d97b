// Route A: the same bridge functions as a pybind11 module (opsmith._pybind),
// outside the dispatcher; opsmith/pybind.py wraps them in autograd.Functions.
#include <torch/extension.h>

#include "bridge.h"

PYBIND11_MODULE(_pybind, m) {
    m.doc() = "opsmith route A: pybind11 bindings over the C kernels";
    m.def("rms_norm_fwd", &opsmith::rms_norm_fwd, "RMSNorm forward: (y, inv_rms)", py::arg("x"),
          py::arg("weight"), py::arg("eps") = py::none());
    m.def("rms_norm_bwd", &opsmith::rms_norm_bwd, "RMSNorm backward: (dx, dweight)", py::arg("dy"),
          py::arg("x"), py::arg("weight"), py::arg("inv_rms"));
}
