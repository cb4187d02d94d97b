"""One Llama-3.2-1B training step (4 x 4096 bf16, fused torch AdamW) under torch.compile,
kernel time by kind: why opsmith-patched + compile (49k tok/s) runs slower than opsmith eager (63k).
python .stage/compile_profile.py hf|opsmith [compile|eager]"""
import os, re, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.getcwd())
import transformers
from opsmith.e2e_bench import LLAMA_3_2_1B
which, mode = sys.argv[1], sys.argv[2]
if which == "opsmith":
    import opsmith.hf
    opsmith.hf.patch_llama()
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**LLAMA_3_2_1B)
cfg._attn_implementation = "sdpa"
model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
ids = torch.randint(0, cfg.vocab_size, (4, 4096), device="cuda")
fwd = torch.compile(model) if mode == "compile" else model
if mode == "layers":  # regional: each decoder layer compiled, the mask built eagerly
    for layer in model.model.layers:
        layer.compile()
def step():
    opt.zero_grad(set_to_none=True)
    fwd(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
t0 = time.time()
for _ in range(3): step()
torch.cuda.synchronize(); print(f"warmup {time.time() - t0:.0f} s")
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(2): step()
    torch.cuda.synchronize()
evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
kinds = {}
for e in evs:
    k = e.key.lower()
    kind = ("gemm" if re.search(r"gemm|nvjet|cutlass|sm90_xmma|cublas", k) else
            "attention" if re.search(r"flash|fmha|attention|sdpa", k) else "opsmith" if "opsmith" in k else
            "triton" if "triton" in k else "adamw" if "adam" in k else "other")
    kinds[kind] = kinds.get(kind, 0) + e.device_time_total / 2
total = sum(e.device_time_total for e in evs) / 2
print(f"== {which} {mode}: {total / 1e3:.1f} ms of kernels a step; " +
      ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
for e in sorted(evs, key=lambda e: -e.device_time_total)[:30]:
    print(f"  {e.device_time_total / 2e3:7.2f} ms {e.count / 2:6.0f}x  {e.key[:120]}")
