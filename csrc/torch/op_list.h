// Every op's bridge file, one line each: csrc/torch/<op>.cpp defines
// bind_<op>(module) for route A (pybind.cpp calls them all) and registers its
// own schemas, kernels and autograd for route B. Adding an op adds one line.
#pragma once

#define OPSMITH_OPS(X) \
    X(rms_norm)
