"""One opsmith-patched (or Liger) Llama-3.2-1B training step, 4 x 4096 bf16: kernel time by kind."""
import sys, os, re, torch, transformers
sys.path.insert(0, os.getcwd())
from opsmith.e2e_bench import LLAMA_3_2_1B
from torch.profiler import profile, ProfilerActivity
which = sys.argv[1]
if which == "opsmith":
    import opsmith.hf; opsmith.hf.patch_llama()
else:
    from liger_kernel.transformers import apply_liger_kernel_to_llama; apply_liger_kernel_to_llama()
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**LLAMA_3_2_1B); cfg._attn_implementation = "sdpa"
model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
ids = torch.randint(0, cfg.vocab_size, (4, 4096), device="cuda")
def step():
    opt.zero_grad(set_to_none=True); model(input_ids=ids, labels=ids).loss.backward(); opt.step()
for _ in range(3): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(2): step()
    torch.cuda.synchronize()
evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
total = sum(e.device_time_total for e in evs) / 2
kinds = {}
for e in evs:
    k = e.key.lower()
    kind = ("gemm" if re.search(r"gemm|nvjet|cutlass|sm90_xmma|cublas", k) else "attention" if re.search(r"flash|fmha|attention", k)
            else "opsmith" if "opsmith" in k else "triton" if "triton" in k else "adamw" if "adam" in k else "other")
    kinds[kind] = kinds.get(kind, 0) + e.device_time_total / 2
print(f"== {which}: {total/1e3:.1f} ms of kernels a step; " + ", ".join(f"{k} {v/1e3:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
for e in sorted(evs, key=lambda e: -e.device_time_total)[:40]:
    print(f"  {e.device_time_total/2e3:7.2f} ms {e.count/2:6.0f}x  {e.key[:120]}")
