"""What a user does first after `pip install`: import opsmith from some other
directory, run an op through both routes, and find the C library the
package carries. Run by `make install-check`; exits non-zero on any surprise.

    python examples/installed_check.py [--editable]
"""
import os
import sys

import torch

import opsmith
import opsmith.pybind

SOURCE_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    editable = "--editable" in sys.argv[1:]
    where = os.path.dirname(os.path.abspath(opsmith.__file__))
    from_source = where == os.path.join(SOURCE_TREE, "opsmith")
    print(f"opsmith {opsmith.__version__} imported from {where}")
    if editable != from_source:
        print(f"expected the package {'from' if editable else 'installed apart from'} the source tree {SOURCE_TREE}")
        return 1
    if os.getcwd().startswith(where):
        print("run this from another directory")
        return 1

    x = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.rms_norm(x, (64,), w, 1e-6)
    (dx_ref,) = torch.autograd.grad(ref.sum(), x)
    for name, fn in (("route B", opsmith.rms_norm), ("route A", opsmith.pybind.rms_norm)):
        y = fn(x, w, 1e-6)
        (dx,) = torch.autograd.grad(y.sum(), x)
        err = max((y - ref).abs().max().item(), (dx - dx_ref).abs().max().item())
        print(f"{name}: max |opsmith - torch| = {err:.2e}")
        if not err < 1e-10:
            return 1
    lib = opsmith.c_library()
    print(f"C library: {lib} (headers in {opsmith.c_include_dir()})")
    if not os.path.isfile(lib) or not os.path.isfile(os.path.join(opsmith.c_include_dir(), "opsmith.h")):
        return 1
    print("installed package ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
