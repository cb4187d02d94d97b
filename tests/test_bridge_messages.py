"""The bridge's error messages format numbers with text() (csrc/torch/tensor_args.h),
never by streaming them into TORCH_CHECK: c10::str streams its arguments
through an ostringstream, and an integer or a double streamed there crashed
the process with a segmentation fault on the GPU machine (Python 3.12, torch
2.11) where strings do not: cross_entropy's weight-shape check did, with a
bare logits.size(1). A bug of that kind shows only on the failing path, on
one machine, so it is checked here in the sources, for every op and for the
templates `opsmith new-op` generates bridges from. No compiled part needed."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "csrc" / "torch").glob("*.cpp"), *(ROOT / "csrc" / "torch").glob("*.h"),
                  *(ROOT / "opsmith" / "templates" / "new_op").glob("*/*.cpp.in"),
                  *(ROOT / "opsmith" / "templates" / "new_op").glob("*/*.h.in")])

CHECK = re.compile(r"\b(?:TORCH_CHECK(?:_[A-Z_]+)?|TORCH_INTERNAL_ASSERT)\s*\(")
# an argument computing a number: a tensor's size, stride, dim, numel..., a
# literal number, or a name declared here with an arithmetic type
NUMERIC_CALL = re.compile(r"\.\s*(?:size|sizes\(\)\s*\[|stride|dim|numel|storage_offset|element_size|itemsize|"
                          r"get_device|nbytes)\s*\(?")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?[uUlLfF]*")
DECLARED = re.compile(r"\b(?:u?int(?:8|16|32|64)_t|size_t|ptrdiff_t|int|long|unsigned|float|double|bool)\s+"
                      r"(?:const\s+)?[&*]?\s*(\w+)\s*[,;=)\[]")


def split_args(src, start):
    """The top-level arguments of the call whose '(' ends just before start."""
    args, cur, depth, i = [], [], 1, start
    while True:
        c = src[i]
        if c in "\"'":  # a literal: kept whole
            j = i + 1
            while src[j] != c:
                j += 2 if src[j] == "\\" else 1
            cur.append(src[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(cur).strip())
                return args
        if c == "," and depth == 1:
            args.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1


def streamed_numbers(path):
    src = re.sub(r"//[^\n]*", lambda m: " " * len(m.group()), path.read_text())
    numeric_names = set(DECLARED.findall(src))
    for m in CHECK.finditer(src):
        line = src.count("\n", 0, m.start()) + 1
        for arg in split_args(src, m.end())[1:]:  # the condition is not part of the message
            if arg.startswith("text(") or re.fullmatch(r'("(?:[^"\\]|\\.)*"\s*)+', arg):
                continue
            # a conditional picking between literals is a string
            body = re.sub(r'"(?:[^"\\]|\\.)*"', '""', arg)
            if (NUMERIC_CALL.search(body) or NUMBER.fullmatch(arg) or
                    (re.fullmatch(r"\*?\w+", arg) and arg.lstrip("*") in numeric_names)):
                yield f"{path.relative_to(ROOT)}:{line}: {arg}"


def test_the_checks_are_found():
    # the scan sees the bridge's checks (a broken pattern would pass everything)
    found = sum(len(CHECK.findall(p.read_text())) for p in SOURCES)
    assert found > 100, found


def test_no_number_is_streamed_into_an_error_message():
    bad = [hit for p in SOURCES for hit in streamed_numbers(p)]
    assert not bad, ("numbers streamed into TORCH_CHECK messages; format them with text() "
                     "(csrc/torch/tensor_args.h says why):\n" + "\n".join(bad))


def test_the_rule_catches_what_crashed(tmp_path):
    # the check that crashed on the GPU machine, as it was
    p = tmp_path / "x.cpp"
    p.write_text('void f(const at::Tensor &logits, int64_t reduction) {\n'
                 '    TORCH_CHECK(w.size(0) == logits.size(1), kOp, ": weight must have shape [",\n'
                 '                logits.size(1), "] (one per class), got ", text(w.sizes()));\n'
                 '    TORCH_CHECK(reduction <= 2, kOp, ": reduction must be 0, 1 or 2, got ", reduction);\n'
                 '    TORCH_CHECK(ok, kOp, ": got ", text(logits.size(1)), " and ", flag ? "a" : "b");\n}\n')
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        hits = list(streamed_numbers(p))
    finally:
        ROOT = root
    assert hits == ["x.cpp:2: logits.size(1)", "x.cpp:4: reduction"], hits
