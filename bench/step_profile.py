"""One training step of a Hugging Face Llama with the Llama-3.2-1B configuration
(random weights, bf16, 4 x 4096 tokens, fused torch AdamW): its CUDA kernels by
kind (torch.profiler), the 30 longest listed.

    python bench/step_profile.py hf|liger|opsmith [eager|compile|layers]

hf: Hugging Face as it is; liger / opsmith: patched. compile: the whole model
under torch.compile; layers: each decoder layer compiled (layer.compile()).
Run from the repository root with the library built (a GPU)."""
import os
import re
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = (("gemm", r"gemm|nvjet|cutlass|sm90_xmma|cublas"), ("attention", r"flash|fmha|attention|sdpa"),
         ("opsmith", r"opsmith"), ("triton", r"triton"), ("adamw", r"adam"))


def kind_of(kernel: str) -> str:
    k = kernel.lower()
    return next((name for name, pattern in KINDS if re.search(pattern, k)), "other")


def report(name: str, events, steps: int, top: int = 30) -> None:
    kinds = {}
    for e in events:
        kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0) + e.device_time_total / steps
    total = sum(e.device_time_total for e in events) / steps
    print(f"== {name}: {total / 1e3:.1f} ms of kernels a step; " +
          ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / (steps * 1e3):7.2f} ms {e.count / steps:6.0f}x  {e.key[:120]}")


def profile_step(which: str, mode: str = "eager", steps: int = 2, warmup: int = 3, top: int = 30) -> None:
    import transformers
    sys.path.insert(0, os.getcwd())
    from opsmith.e2e_bench import LLAMA_3_2_1B
    if which == "opsmith":
        import opsmith.hf
        opsmith.hf.patch_llama()
    elif which == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA_3_2_1B)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (4, 4096), device="cuda")
    forward = torch.compile(model) if mode == "compile" else model
    if mode == "layers":
        for layer in model.model.layers:
            layer.compile()

    def step():
        opt.zero_grad(set_to_none=True)
        # training: no key/value cache (it would also recompile each compiled layer)
        forward(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    t0 = time.time()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    print(f"warmup {time.time() - t0:.0f} s")
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    report(f"{which} {mode}", events, steps, top)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("hf", "liger", "opsmith") or \
            (len(sys.argv) > 2 and sys.argv[2] not in ("eager", "compile", "layers")):
        sys.exit(__doc__)
    profile_step(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "eager")
