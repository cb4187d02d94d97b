"""CPU outputs of at least two whole 2 MB pages are advised as transparent
huge pages before the kernel's first write (csrc/torch/tensor_args.h,
advise_huge_pages): the region's mapping carries the kernel's "hg" flag
(MADV_HUGEPAGE) in /proc/self/smaps. OPSMITH_CPU_HUGE_PAGES=0 turns it off."""
import os
import subprocess
import sys

import pytest
import torch

import opsmith

HUGE = 1 << 21
linux_thp = pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
                               or not os.path.exists("/proc/self/smaps"),
                               reason="needs Linux with transparent huge pages")


def vm_flags(address):
    """The VmFlags of the mapping of this process that holds address."""
    start = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                start = lo <= address < hi
            elif start and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def first_huge_page(t):
    return (t.data_ptr() + HUGE - 1) // HUGE * HUGE


@linux_thp
def test_large_cpu_outputs_are_advised_huge_pages():
    x = torch.randn(2048, 2048)  # 16 MB
    for y in (opsmith.softmax(x), opsmith.rms_norm(x, torch.ones(2048)),
              opsmith.layer_norm(x, torch.ones(2048), torch.zeros(2048))):
        torch.testing.assert_close(y.isfinite().all(), torch.tensor(True))
        assert "hg" in vm_flags(first_huge_page(y)), "a 16 MB CPU output was not advised as huge pages"


@linux_thp
def test_the_switch_turns_the_advice_off():
    code = ("import torch, opsmith, sys; sys.path.insert(0, sys.argv[1]); from test_huge_pages import *; "
            "y = opsmith.softmax(torch.randn(2048, 2048)); print('hg' in vm_flags(first_huge_page(y)))")
    env = dict(os.environ, OPSMITH_CPU_HUGE_PAGES="0")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "OPSMITH_CPU_HUGE_PAGES=0 still advised huge pages"
