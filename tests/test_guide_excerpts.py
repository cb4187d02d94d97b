"""docs/guide.md quotes opsmith's own files ("Every excerpt is from opsmith's
own files, shortened where marked `...`"): every line of its C, C++, CUDA,
Python and CMake excerpts must still be in one of them, so an excerpt goes
stale in a failing test rather than in a reader's hands. Examples of use,
which quote nothing, are fenced as `py` and not checked."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANGS = {"c", "cpp", "cuda", "python", "cmake"}
SOURCES = ("csrc", "include", "opsmith", "examples", "tests", "setup.py", "CMakeLists.txt")
SUFFIXES = (".c", ".h", ".cu", ".cuh", ".cpp", ".py", ".txt", ".in")


def _norm(line):
    return re.sub(r"\s+", " ", line.strip())


def _source_lines():
    lines = set()
    for entry in SOURCES:
        path = os.path.join(ROOT, entry)
        paths = [path] if os.path.isfile(path) else [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(SUFFIXES)]
        for p in paths:
            with open(p, encoding="utf-8", errors="replace") as fh:
                lines.update(_norm(x) for x in fh)
    return lines


def _excerpts():
    """(line number in the guide, line) of every line of a fenced excerpt in LANGS"""
    with open(os.path.join(ROOT, "docs", "guide.md"), encoding="utf-8") as fh:
        text = fh.read().splitlines()
    lang = None
    for i, line in enumerate(text, 1):
        fence = re.match(r"\s*```(\w*)\s*$", line)
        if fence:
            lang = None if lang is not None else fence.group(1) or ""
            continue
        if lang in LANGS:
            yield i, line


def test_guide_excerpts_are_in_the_sources():
    have = _source_lines()
    checked, stale = 0, []
    for i, line in _excerpts():
        n = _norm(line)
        if not n or "..." in n or n in ("{", "}", "};", ")", "});"):
            continue
        checked += 1
        if n not in have:
            stale.append(f"docs/guide.md:{i}: {line.strip()}")
    assert checked > 50, f"only {checked} excerpt lines found: did the guide's fences change?"
    assert not stale, "excerpt lines no longer in the sources:\n" + "\n".join(stale)
