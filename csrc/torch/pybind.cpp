// Route A: opsmith._pybind, a pybind11 module over the same bridge functions
// as route B, outside the dispatcher; opsmith/ops/<op>.py wraps them in
// torch.autograd.Functions. Each op's binding lives in its bridge file
// (OPSMITH_PYBIND), compiled into this module with OPSMITH_ROUTE_A=1, so it
// registers nothing with the dispatcher; here every enrolled op is bound.
#include "pybind_registry.h"

PYBIND11_MODULE(_pybind, m) {
    m.doc() = "opsmith route A: pybind11 bindings over the C kernels";
    pybind11::list ops;
    for (const auto &[op, bind] : opsmith::pybind_registry()) {
        bind(m);
        ops.append(op);
    }
    m.attr("OPS") = ops; // the ops bound, for tests
}
