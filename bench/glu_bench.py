"""The gated activations' benchmark: SwiGLU, GeGLU (exact) and GeGLU (tanh),
each against eager PyTorch, torch.compile of it and Liger where Liger has
it (SiLU-mul; GELU-mul is tanh-only there), through `opsmith bench`'s own
machinery (same timing, bytes model, tables and plots). The op spec's default
entry ("glu") is the SwiGLU one; this adds the two GeGLU entries beside it.

    python bench/glu_bench.py --quick --out bench/results/<dir>        # a few shapes, bf16
    python bench/glu_bench.py --dtypes bf16 f32 --out bench/results/<dir>
Any `opsmith bench` argument passes through; without --ops all three run."""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the in-place build
from opsmith import bench  # noqa: E402
from opsmith.specs.glu import SPEC, bench_spec  # noqa: E402

ENTRIES = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for name, activation in ENTRIES.items():
        bench.OPS[name] = dataclasses.replace(SPEC, name=name, bench=bench_spec(activation))
    if "--ops" not in argv:
        argv = ["--ops", *ENTRIES, *argv]
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
