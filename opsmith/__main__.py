"""The command line: python -m opsmith (or the `opsmith` script).

    opsmith --help | --version
    opsmith demo [--steps N] [--device cpu|cuda|cuda:N] [--config small|medium] [--out DIR] [--kernels]
    opsmith bench [--quick] [--ops ...] [--providers ...] ...
    opsmith doctor
    opsmith new-op NAME [--out DIR --namespace NS]

Bad arguments end in one line on stderr and exit status 2, never a traceback."""
import sys

COMMANDS = {
    "demo": "train a small Llama-style model built from opsmith's modules beside the same model in plain "
            "PyTorch, losses, tokens/s, memory and per-op times compared (--kernels: the RMSNorm kernel check)",
    "bench": "the benchmark suite on a CUDA GPU (opsmith bench --help for its options)",
    "doctor": "what this machine has and what opsmith built: versions, GPU and its arch, the "
              "arches the library carries, which routes load, OpenMP threads, and how to fix what is wrong",
    "new-op": "write a new operator NAME, a working elementwise op with its backward, into every layer "
              "of this tree (or, with --out DIR --namespace NS, as a standalone project) for you to edit",
}

USAGE = "usage: opsmith [--help] [--version] {" + ",".join(COMMANDS) + "} ..."


def _help() -> str:
    lines = [USAGE, "", "Fused operators for PyTorch in C and CUDA C.", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help     this text", "  --version      opsmith's, its C ABI's and torch's versions",
              "", "`opsmith COMMAND --help` describes a command's own options."]
    return "\n".join(lines)


def _fail(message: str) -> int:
    print(f"opsmith: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    if argv[0] == "--version":
        import torch

        import opsmith
        from ._library import c_abi
        print(f"opsmith {opsmith.__version__} (C ABI {c_abi()}, torch {torch.__version__})")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        return _fail(f"unknown command {command!r} (commands: {', '.join(COMMANDS)}; opsmith --help)")
    if command == "demo":
        from .train_demo import main as run
    elif command == "bench":
        from .bench import main as run
    elif command == "new-op":
        from .new_op import main as run
    else:
        from .doctor import main as run
    try:
        return run(rest)
    except SystemExit as e:  # argparse: it has printed its one-line error already
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
