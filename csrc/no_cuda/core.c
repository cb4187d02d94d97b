/* Linked instead of the CUDA objects when the library is built without
 * nvcc (csrc/no_cuda/<op>.c: every CUDA launcher exists and says so). */
#include "internal.h"

int opsmith_has_cuda(void) { return 0; }
