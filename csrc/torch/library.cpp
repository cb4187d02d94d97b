// Route B: the opsmith namespace in the PyTorch dispatcher, defined once.
// Each op adds its schemas and kernels with TORCH_LIBRARY_FRAGMENT in its
// own bridge file (csrc/torch/<op>.cpp), which also names the Python module
// holding its fake (shape-only) kernels, so the dispatcher can import it
// when this library is loaded on its own.
#include <torch/library.h>

TORCH_LIBRARY(opsmith, m) {}
