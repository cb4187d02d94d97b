// Route A: opsmith._pybind, a pybind11 module over the same bridge functions
// as route B, outside the dispatcher; opsmith/ops/<op>.py wraps them in
// torch.autograd.Functions. Each op's bind_<op> lives in its bridge file,
// compiled here with OPSMITH_ROUTE_A so it registers nothing with the dispatcher.
#include <torch/extension.h>

#include "op_list.h"

namespace opsmith {
#define OPSMITH_DECLARE_BIND(op) void bind_##op(pybind11::module_ &m);
OPSMITH_OPS(OPSMITH_DECLARE_BIND)
#undef OPSMITH_DECLARE_BIND
} // namespace opsmith

PYBIND11_MODULE(_pybind, m) {
    m.doc() = "opsmith route A: pybind11 bindings over the C kernels";
#define OPSMITH_CALL_BIND(op) opsmith::bind_##op(m);
    OPSMITH_OPS(OPSMITH_CALL_BIND)
#undef OPSMITH_CALL_BIND
}
