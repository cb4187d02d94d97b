"""Static instruction counts of CUDA kernels, from their SASS: the whole
kernel and each loop (a backward branch and the instructions it jumps back
over), so a change to a hot loop is counted on a machine without a GPU.

    python bench/sass_loops.py OBJECT_OR_CUBIN [--kernel REGEX] [--json]

OBJECT_OR_CUBIN: an object built with sm_90 code (build/csrc/cuda/*.o) or a
cubin. cuobjdump is taken from PATH, $CUDA_HOME/bin or the copy triton
ships. A loop's count is static: it includes the paths its branches skip
(a NaN test's body), so it is an upper bound of what one trip issues; the
per-element figure divides it by the elements a trip handles, which the
reader supplies (a 16-byte pack of bf16 is 8)."""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys

_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(home, "bin", "cuobjdump")):
        return os.path.join(home, "bin", "cuobjdump")
    try:
        import triton  # its NVIDIA backend carries cuobjdump
        hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
        if hits:
            return hits[0]
    except ImportError:
        pass
    sys.exit("sass_loops: no cuobjdump (PATH, $CUDA_HOME/bin, or triton's)")


def functions(path: str):
    """{name: [(address, instruction text)]} of every sm_90 function in path."""
    out = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    funcs, name = {}, None
    for line in out.splitlines():
        if "Function :" in line:
            name = line.split("Function :", 1)[1].strip()
            funcs[name] = []
            continue
        m = _LINE.match(line)
        if name and m:
            funcs[name].append((int(m.group(1), 16), m.group(2)))
    return funcs


def loops(instrs):
    """(start, end, count) of each backward branch's span, innermost first."""
    found = []
    for addr, text in instrs:
        m = _BRA.search(text)
        if m and not text.startswith("@!PT"):
            target = int(m.group(1), 16)
            if target < addr:
                found.append((target, addr, sum(1 for a, _ in instrs if target <= a <= addr)))
    return sorted(found, key=lambda l: l[2])


def report(path, pattern):
    rows = []
    for name, instrs in functions(path).items():
        if pattern and not re.search(pattern, name):
            continue
        # the function's end: NOP padding and the branch to itself after EXIT
        body = [(a, t) for a, t in instrs if t != "NOP" and t != f"BRA {hex(a)}"]
        rows.append({"kernel": name, "instructions": len(body),
                     "loops": [{"start": hex(s), "end": hex(e), "instructions": n} for s, e, n in loops(instrs)]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--kernel", default="", help="regex over the mangled names")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = report(a.path, a.kernel)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"{r['instructions']:6d}  {r['kernel']}")
        for lp in r["loops"]:
            print(f"        loop {lp['start']}-{lp['end']}: {lp['instructions']} instructions")


if __name__ == "__main__":
    main()
