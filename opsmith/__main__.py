"""python -m opsmith demo | bench ..."""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m opsmith demo [--device cpu|cuda] | bench [--ops ...] [--quick]")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo_main
        return demo_main(rest)
    if command == "bench":
        from .bench import main as bench_main
        return bench_main(rest)
    print(f"opsmith: unknown command {command!r} (try: demo, bench)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
