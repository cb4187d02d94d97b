"""`python -m opsmith bench --e2e`: one full training step (forward, backward,
optimizer) of a Hugging Face Llama with the Llama-3.2-1B configuration
(random weights), bfloat16, sequence 4096, under each configuration:

    hf_eager         Hugging Face as it is (fused torch AdamW)
    hf_compile       the same with torch.compile (each decoder layer; see below)
    liger            Liger-Kernel's apply_liger_kernel_to_llama (fused torch AdamW)
    opsmith          opsmith.hf.patch_llama (fused torch AdamW: the kernels
                     compared with the optimizer held equal)
    opsmith_adamw    opsmith.hf.patch_llama and opsmith.optim.AdamW, whose
                     moments are float32 whatever the param dtype (torch's
                     are in the param's dtype: 4 more bytes a bf16 param)
    opsmith_compile  opsmith (fused torch AdamW) with torch.compile (each decoder layer)

The compiled configurations compile each decoder layer (regional compilation),
not the whole model: in a whole-model graph Hugging Face builds the causal
mask as a dense [batch, 1, seq, seq] tensor and passes it to
scaled_dot_product_attention with is_causal=False (eager passes no mask and
is_causal=True), so attention computes every square of the 4096 x 4096 score
matrix: 127 ms of kernels a step against 45 (H100,
bench/results/2026-12-06-h100-decode-v4/). The forward runs with
use_cache=False (training: no key/value cache, which would also recompile the
layers once each).

Peak memory is reported for the step and for each of its phases (forward,
backward, optimizer), each from the allocation at the start of that phase.

Each configuration runs in its own process (patches are process-wide and
memory is measured from a clean start): tokens/s over timed steps after
warm-up, and the peak allocated memory. `--max-batch` also finds the largest
batch each fits, starting from the batch its measured memory predicts (two
probes when that is right: it fits and one more does not). Results as JSON,
a Markdown table and a PNG under --out; `--merge DIR...` joins runs made in
parts."""
import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = ("hf_eager", "hf_compile", "liger", "opsmith", "opsmith_adamw", "opsmith_compile")

LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False)


# a few-layer stand-in for the smoke test on a machine without a GPU
TINY = dict(LLAMA_3_2_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def one(config: str, batch: int, seq: int, steps: int, warmup: int, device: str = "cuda",
        tiny: bool = False) -> dict:
    """Runs in a child process: build, patch, train `warmup + steps` steps."""
    import torch
    import transformers
    torch.manual_seed(0)
    device = torch.device(device)
    cuda = device.type == "cuda"
    optimizer_name = "torch AdamW (fused)" if cuda else "torch AdamW"
    if config.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    if config.startswith("opsmith"):
        import opsmith.hf
        opsmith.hf.patch_llama()
    cfg = transformers.LlamaConfig(**(TINY if tiny else LLAMA_3_2_1B))
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    model.train()
    if config == "opsmith_adamw":
        import opsmith.optim
        opt = opsmith.optim.AdamW(model.parameters(), lr=1e-5)
        optimizer_name = "opsmith AdamW"
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    if config.endswith("compile"):
        for layer in model.model.layers:
            layer.compile()
    g = torch.Generator(device=device).manual_seed(1)  # the same tokens for every configuration
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g)

    def step(phases=None):
        # phases: a dict to fill with each phase's peak allocation (GiB);
        # resetting the peak per phase, so never inside the timed steps
        def phase(name, fn):
            if phases is None:
                return fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = fn()
            torch.cuda.synchronize()
            phases[name] = torch.cuda.max_memory_allocated() / 2**30
            return out

        opt.zero_grad(set_to_none=True)
        if phases is not None:
            phases["before"] = torch.cuda.memory_allocated() / 2**30
        loss = phase("forward", lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
        phase("backward", loss.backward)
        phase("optimizer", opt.step)
        return loss

    for _ in range(warmup):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    peak_gib, phase_gib = float("nan"), {}
    if cuda:
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        step(phase_gib)  # params, grads and optimizer state before the step, then each phase's peak
    return {"config": config, "batch": batch, "seq": seq, "ms_per_step": ms,
            "tokens_per_s": batch * seq / (ms / 1e3),
            "peak_gib": peak_gib, "phase_gib": phase_gib,
            "loss": loss.item(), "optimizer": optimizer_name, "transformers": transformers.__version__,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "device_gib": torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None}


def _child(config, batch, seq, steps, warmup, timeout):
    cmd = [sys.executable, "-m", "opsmith.e2e_bench", "--one", config, "--batch", str(batch), "--seq", str(seq),
           "--steps", str(steps), "--warmup", str(warmup)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"config": config, "batch": batch, "error": f"timed out after {timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    oom = any("OutOfMemory" in l or "out of memory" in l for l in (p.stderr or "").splitlines())
    return {"config": config, "batch": batch, "error": "out of memory" if oom else " | ".join(tail)[-400:]}


def batch_guess(measured: dict, limit: int) -> int:
    """The largest batch the measured run's memory predicts, taking the peak
    beyond the step's starting allocation (weights, optimizer state) as
    proportional to the batch, and 2 GiB of the device as the context's and
    the allocator's. The search below only starts there: it verifies."""
    before = (measured.get("phase_gib") or {}).get("before")
    device_gib, peak, batch = measured.get("device_gib"), measured.get("peak_gib"), measured.get("batch")
    if not (before is not None and device_gib and peak and batch) or peak <= before:
        return 1
    per_batch = (peak - before) / batch
    return max(1, min(limit, int((device_gib - 2.0 - before) / per_batch)))


def largest_fitting(fits, ok: int, guess: int, limit: int) -> int:
    """The largest b <= limit with fits(b), given fits(ok) (0: none known) and
    fits monotone: from `guess` gallop up (or down) until the answer changes,
    then bisect. A right guess costs two probes (guess fits, guess + 1 not)."""
    bad = limit + 1
    b = min(max(guess, ok + 1), limit)
    step = 1
    if b <= ok:
        return ok
    if fits(b):
        ok = b
        while ok < limit:
            b = min(ok + step, limit)
            if not fits(b):
                bad = b
                break
            ok, step = b, step * 2
        else:
            return ok
    else:
        bad = b
        while bad - ok > 1:
            b = max(bad - step, ok + 1)
            if fits(b):
                ok = b
                break
            bad, step = b, step * 2
    while bad - ok > 1:
        mid = (ok + bad) // 2
        ok, bad = (mid, bad) if fits(mid) else (ok, mid)
    return ok


def max_batch(config, seq, timeout, measured=None, limit=256):
    """The largest batch that trains a step without running out of memory,
    searched from the guess the measured run's memory gives."""
    def fits(b):
        return "error" not in _child(config, b, seq, 1, 1, timeout)
    ok = measured["batch"] if measured and "error" not in measured else 0
    return largest_fitting(fits, ok, batch_guess(measured or {}, limit), limit)


def table(results) -> str:
    rows = ["| configuration | batch x seq | tokens/s | ms/step | peak GiB | before / forward / backward / "
            "optimizer peak GiB | max batch | optimizer | loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['config']} | {r.get('batch')} | failed: {r['error']} | | | | | | |")
            continue
        ph = r.get("phase_gib") or {}
        phases = " / ".join(f"{ph[k]:.1f}" for k in ("before", "forward", "backward", "optimizer") if k in ph)
        rows.append(f"| {r['config']} | {r['batch']}x{r['seq']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                    f"{r['peak_gib']:.1f} | {phases} | {r.get('max_batch', '')} | {r['optimizer']} | "
                    f"{r['loss']:.4f} |")
    return "\n".join(rows)


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["config"] for r in ok]
    axes[0].bar(names, [r["tokens_per_s"] for r in ok])
    axes[0].set_ylabel("tokens/s")
    axes[1].bar(names, [r["peak_gib"] for r in ok], color="tab:orange")
    axes[1].set_ylabel("peak GiB")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"Llama-3.2-1B config, bf16, batch {ok[0]['batch']} x {ok[0]['seq']}: one training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out_dir, configs=CONFIGS, batch=4, seq=4096, steps=5, warmup=3, find_max=False, timeout=900) -> int:
    import torch
    if not torch.cuda.is_available():
        print("opsmith bench --e2e: needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    for config in configs:
        t0 = time.time()
        r = _child(config, batch, seq, steps, warmup, timeout)
        if find_max and "error" not in r:
            r["max_batch"] = max_batch(config, seq, timeout, measured=r)
        results.append(r)
        print(f"{config}: " + (f"{r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_gib']:.1f} GiB"
                               if "error" not in r else f"failed: {r['error']}") + f" ({time.time() - t0:.0f} s)",
              flush=True)
    return write(out_dir, results)


def write(out_dir, results) -> int:
    """e2e.json, e2e.md and e2e.png under out_dir; 1 if a configuration failed."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "e2e.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = table(results)
    with open(os.path.join(out_dir, "e2e.md"), "w") as f:
        f.write(text + "\n")
    plot(results, os.path.join(out_dir, "e2e.png"))
    print(text)
    return 0 if all("error" not in r for r in results) else 1


def merge(out_dir, parts) -> int:
    """One table of runs made in parts (each an --out directory of a subset of
    the configurations, on one machine), in CONFIGS order."""
    results = []
    for d in parts:
        with open(os.path.join(d, "e2e.json")) as f:
            results += json.load(f)
    gpus = {r.get("gpu") for r in results if "error" not in r}
    if len(gpus) > 1:
        print(f"opsmith.e2e_bench --merge: the parts ran on different GPUs ({sorted(gpus)})", file=sys.stderr)
        return 2
    results.sort(key=lambda r: CONFIGS.index(r["config"]) if r["config"] in CONFIGS else len(CONFIGS))
    return write(out_dir, results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="opsmith.e2e_bench")
    p.add_argument("--one", choices=CONFIGS)
    p.add_argument("--configs", nargs="*", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-batch", action="store_true")
    p.add_argument("--out", default=os.path.join("bench", "results", "latest-e2e"))
    p.add_argument("--device", default="cuda", help="with --one: cpu for the smoke test")
    p.add_argument("--tiny", action="store_true", help="with --one: a 2-layer stand-in (smoke test)")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="combine these runs' e2e.json into --out")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.out, args.merge)
    if args.one:
        print(json.dumps(one(args.one, args.batch, args.seq, args.steps, args.warmup, args.device, args.tiny)))
        return 0
    return run(args.out, args.configs, args.batch, args.seq, args.steps, args.warmup, args.max_batch)


if __name__ == "__main__":
    sys.exit(main())
