// Route A's registry: each op's bridge file enrolls its binding function
// with OPSMITH_PYBIND(op) { m.def(...); }, at static-initialisation time of
// opsmith._pybind, and PYBIND11_MODULE (pybind.cpp) calls every one. Adding
// an op adds no line anywhere else.
#pragma once

#include <torch/extension.h>

#include <utility>
#include <vector>

namespace opsmith {

using BindFn = void (*)(pybind11::module_ &);

// Function-local static: filled before the module's init runs, whatever
// order the translation units' initialisers take.
inline std::vector<std::pair<const char *, BindFn>> &pybind_registry() {
    static std::vector<std::pair<const char *, BindFn>> binders;
    return binders;
}

struct RegisterPybind {
    RegisterPybind(const char *op, BindFn fn) { pybind_registry().emplace_back(op, fn); }
};

} // namespace opsmith

#define OPSMITH_PYBIND(op)                                                                      \
    static void opsmith_bind_##op(pybind11::module_ &m);                                        \
    static const ::opsmith::RegisterPybind opsmith_pybind_registration_##op(#op, opsmith_bind_##op); \
    static void opsmith_bind_##op(pybind11::module_ &m)
