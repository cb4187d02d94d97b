"""`make demo`: a small Llama-style decoder trained twice from the same seed,
once built from opsmith's modules and once in plain PyTorch, on byte-level
text that every machine has (the Python standard library's own source
files, read at run time: nothing is downloaded).

Printed: both losses every few steps (they must agree: the two models
compute the same function, so only rounding separates them), tokens/s and
peak memory of each, and a per-op time table (forward+backward of each op at
the model's shapes, opsmith against PyTorch). Written under --out: the loss
curves and the per-op times as PNG (when matplotlib is present) and
everything as JSON.

    python -m opsmith demo [--steps N] [--device cpu|cuda] [--config small|medium] [--out DIR]

What comes from opsmith in the opsmith model: RMSNorm and the fused residual
add + RMSNorm, the gated MLP (SwiGLU), and, where this build has them, the
rotary embedding, the lm_head and cross-entropy fused (no logits), and the
AdamW step; anything missing is named in the output and taken from PyTorch."""
import json
import math
import os
import pathlib
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List

import torch
import torch.nn.functional as F

import opsmith

from ._cli import Parser


@dataclass
class Config:
    d_model: int
    layers: int
    heads: int
    intermediate: int
    seq: int
    batch: int
    steps: int
    lr: float
    dtype: str  # "float32", or "bfloat16" for autocast on CUDA


CONFIGS = {
    # about two minutes for both models on a 2-core CPU
    "small": Config(d_model=128, layers=4, heads=4, intermediate=352, seq=128, batch=8, steps=300, lr=2e-3,
                    dtype="float32"),
    "medium": Config(d_model=768, layers=8, heads=12, intermediate=2048, seq=512, batch=16, steps=300, lr=1e-3,
                     dtype="bfloat16"),
}
VOCAB = 256  # bytes


def _optional(name):
    try:
        if name == "optim":
            import opsmith.optim as mod  # noqa: F401
            return mod
        return getattr(opsmith, name)
    except (ImportError, AttributeError):
        return None


# what this build of opsmith has beyond the norms and the gated MLP
APPLY_ROTARY = _optional("apply_rotary")
CROSS_ENTROPY = _optional("cross_entropy")
FUSED_LINEAR_CE = _optional("fused_linear_cross_entropy")
OPTIM = _optional("optim")


# --- data ----------------------------------------------------------------------------------

def stdlib_bytes(limit: int = 4 << 20) -> torch.Tensor:
    """The standard library's .py files, sorted by path, concatenated up to
    `limit` bytes: the same text on every machine with this Python."""
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, cfg: Config, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - cfg.seq - 1, (cfg.batch,), generator=g)
        rows = torch.stack([data[s:s + cfg.seq + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


# --- the model, built two ways -------------------------------------------------------------

def rope_tables(seq: int, head_dim: int, device) -> tuple:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def torch_rotary(q, k, cos, sin):
    """Rotate-half rotary embedding on [B, S, H, D] (Hugging Face's formula)."""
    def rotate_half(t):
        a, b = t.chunk(2, dim=-1)
        return torch.cat([-b, a], dim=-1)
    c, s = cos[None, :, None, :].to(q.dtype), sin[None, :, None, :].to(q.dtype)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


class TorchGatedMLP(torch.nn.Module):
    def __init__(self, d, inter):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, inter, bias=False)
        self.up_proj = torch.nn.Linear(d, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
    """Pre-norm attention + gated MLP. The opsmith block takes the residual
    stream and the previous sublayer's output and adds them inside its first
    norm (fused add + RMSNorm); the PyTorch block adds them itself."""

    def __init__(self, cfg: Config, use_opsmith: bool):
        super().__init__()
        d = cfg.d_model
        self.use_opsmith = use_opsmith
        self.heads = cfg.heads
        if use_opsmith:
            self.attn_norm = opsmith.nn.FusedAddRMSNorm(d, eps=1e-6)
            self.mlp_norm = opsmith.nn.FusedAddRMSNorm(d, eps=1e-6)
            self.mlp = opsmith.nn.GatedMLP(d, cfg.intermediate, activation="silu")
        else:
            self.attn_norm = torch.nn.RMSNorm(d, eps=1e-6)
            self.mlp_norm = torch.nn.RMSNorm(d, eps=1e-6)
            self.mlp = TorchGatedMLP(d, cfg.intermediate)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.o_proj = torch.nn.Linear(d, d, bias=False)

    def attention(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)  # each [B, S, H, Dh]
        if self.use_opsmith and APPLY_ROTARY is not None:
            q, k = APPLY_ROTARY(q, k, cos, sin, layout="bshd")
        else:
            q, k = torch_rotary(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))

    def forward(self, h, delta, cos, sin):
        """h: residual stream before this block's add; delta: the previous
        sublayer's output (zeros for the first block). Returns (h, delta)."""
        if self.use_opsmith:
            # under autocast the sublayers give bf16 while the residual stream
            # stays float32: the fused add takes both in the stream's dtype
            y, h = self.attn_norm(delta.to(h.dtype), h)
            a = self.attention(y, cos, sin)
            y, h = self.mlp_norm(a.to(h.dtype), h)
            return h, self.mlp(y)
        h = h + delta
        h = h + self.attention(self.attn_norm(h), cos, sin)
        return h, self.mlp(self.mlp_norm(h))


class TinyLlama(torch.nn.Module):
    def __init__(self, cfg: Config, use_opsmith: bool):
        super().__init__()
        self.cfg = cfg
        self.use_opsmith = use_opsmith
        self.embed = torch.nn.Embedding(VOCAB, cfg.d_model)
        self.blocks = torch.nn.ModuleList(Block(cfg, use_opsmith) for _ in range(cfg.layers))
        self.norm = (opsmith.nn.FusedAddRMSNorm(cfg.d_model, eps=1e-6) if use_opsmith
                     else torch.nn.RMSNorm(cfg.d_model, eps=1e-6))
        self.lm_head = torch.nn.Linear(cfg.d_model, VOCAB, bias=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def forward(self, ids, targets):
        if self.cos.numel() == 0 or self.cos.device != ids.device:
            self.cos, self.sin = rope_tables(self.cfg.seq, self.cfg.d_model // self.cfg.heads, ids.device)
        h = self.embed(ids)
        delta = torch.zeros_like(h)
        for block in self.blocks:
            h, delta = block(h, delta, self.cos, self.sin)
        if self.use_opsmith:
            y, _ = self.norm(delta.to(h.dtype), h)
        else:
            y = self.norm(h + delta)
        if self.use_opsmith and FUSED_LINEAR_CE is not None:
            # the lm_head and the loss in one op: no [tokens, vocab] logits
            return FUSED_LINEAR_CE(y.flatten(0, 1), self.lm_head.weight, targets.flatten())
        logits = self.lm_head(y).flatten(0, 1)
        if self.use_opsmith and CROSS_ENTROPY is not None:
            return CROSS_ENTROPY(logits, targets.flatten())
        return F.cross_entropy(logits.float(), targets.flatten())


def make_optimizer(model, cfg: Config, use_opsmith: bool):
    params = list(model.parameters())
    if use_opsmith and OPTIM is not None:
        return OPTIM.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, foreach=False)


# --- measurement ---------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BATCH_S, BATCHES = 0.02, 9  # per_op_times: seconds a timed batch at least, batches a provider


def keep_freed_memory() -> bool:
    """Asks glibc's malloc to keep freed memory in the process (no mmap per
    large block, no trim of the heap's top), so a CPU op's output lands on
    pages already mapped. Otherwise each call's outputs and gradients are
    fresh mappings whose page faults cost eager PyTorch 1x-3x its own work,
    differently in each process (the demo's per-op speed-ups moved by up
    to 2x run to run). True where it took effect (Linux with glibc)."""
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    return all(mallopt(opt, val) == 1 for opt, val in
               ((M_MMAP_THRESHOLD, 64 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20)))


def per_op_times(cfg: Config, device, dtype) -> Dict[str, Dict[str, float]]:
    """Forward+backward milliseconds of each op opsmith replaces, at the
    model's shapes: {op: {"opsmith": ms, "torch": ms}} (the fastest batch)."""
    rows, d, heads = cfg.batch * cfg.seq, cfg.d_model, cfg.heads
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, d, generator=g).to(device, dtype)
    r = torch.randn(rows, d, generator=g).to(device, dtype)
    w = torch.ones(d, device=device, dtype=dtype)
    gate = torch.randn(rows, cfg.intermediate, generator=g).to(device, dtype)
    up = torch.randn(rows, cfg.intermediate, generator=g).to(device, dtype)
    q = torch.randn(cfg.batch, cfg.seq, heads, d // heads, generator=g).to(device, dtype)
    k = torch.randn(cfg.batch, cfg.seq, heads, d // heads, generator=g).to(device, dtype)
    cos, sin = rope_tables(cfg.seq, d // heads, device)
    logits = torch.randn(rows, VOCAB, generator=g).to(device, dtype)
    t = torch.randint(0, VOCAB, (rows,), generator=g).to(device)

    def fb(fn, *inputs):
        leaves = [i.detach().requires_grad_() if i.is_floating_point() else i for i in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o for o in outs if o is not None],
                                [torch.ones_like(o) for o in outs if o is not None])

    cases = {
        "rms_norm": (lambda a, b: opsmith.rms_norm(a, b, 1e-6), lambda a, b: F.rms_norm(a, (d,), b, 1e-6),
                     (x, w)),
        "add + rms_norm": (lambda a, c, b: opsmith.fused_add_rms_norm(a, c, b, 1e-6),
                           lambda a, c, b: F.rms_norm(a + c, (d,), b, 1e-6), (x, r, w)),
        "swiglu": (opsmith.swiglu, lambda a, b: F.silu(a) * b, (gate, up)),
    }
    if APPLY_ROTARY is not None:
        cases["rotary"] = (lambda a, b: APPLY_ROTARY(a, b, cos, sin, layout="bshd"),
                           lambda a, b: torch_rotary(a, b, cos, sin), (q, k))
    if CROSS_ENTROPY is not None:
        cases["cross_entropy"] = (lambda a, b: CROSS_ENTROPY(a, b), lambda a, b: F.cross_entropy(a.float(), b),
                                  (logits, t))
    if FUSED_LINEAR_CE is not None:
        head = torch.randn(VOCAB, d, generator=g).to(device, dtype) * d ** -0.5
        cases["lm_head + cross_entropy"] = (lambda a, wh, b: FUSED_LINEAR_CE(a, wh, b),
                                            lambda a, wh, b: F.cross_entropy(F.linear(a, wh).float(), b),
                                            (x, head, t))
    def seconds(fn, inputs, calls):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fb(fn, *inputs)
        _sync(device)
        return time.perf_counter() - t0

    # batches of at least BATCH_S seconds (5 calls were ~1 ms of a 0.2 ms op),
    # the two providers interleaved, the fastest of BATCHES (what else runs on
    # the machine only adds time: medians moved by up to 1.4x between processes)
    out = {}
    for name, (ours, theirs, inputs) in cases.items():
        times = {"opsmith": [], "torch": []}
        calls = 1
        for fn in (ours, theirs):  # warm-up, then the calls a batch from the slower
            fb(fn, *inputs)
            calls = max(calls, min(1000, int(BATCH_S / max(seconds(fn, inputs, 1), 1e-6)) + 1))
        for _ in range(BATCHES):
            for label, fn in (("opsmith", ours), ("torch", theirs)):
                times[label].append(seconds(fn, inputs, calls) * 1e3 / calls)
        out[name] = {k: min(v) for k, v in times.items()}
    return out


def progress(step: int, total: int, losses: Dict[str, float], width: int = 30) -> None:
    done = int(width * step / total)
    text = " ".join(f"{k} {v:.4f}" for k, v in losses.items())
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} {text}")
    sys.stderr.flush()


def train(cfg: Config, device, log_every: int) -> dict:
    """Both models in lockstep on the same batches, each step timed on its
    own and the two taking turns to go first, so a busy machine slows both
    alike. Peak memory (CUDA) is each step's peak above what was allocated
    before it: activations and temporaries, the model's own state aside."""
    torch.manual_seed(0)
    reference = TinyLlama(cfg, use_opsmith=False).to(device)
    model = TinyLlama(cfg, use_opsmith=True).to(device)
    result = model.load_state_dict(reference.state_dict(), strict=True)  # the same start
    assert not result.missing_keys and not result.unexpected_keys
    amp = cfg.dtype == "bfloat16"
    runs = {label: {"model": m, "opt": make_optimizer(m, cfg, use_opsmith=(label == "opsmith")), "losses": [],
                    "seconds": 0.0, "peak_mib": 0.0 if device.type == "cuda" else None}
            for label, m in (("opsmith", model), ("torch", reference))}
    stream = batches(stdlib_bytes(), cfg, seed=1)
    for step in range(1, cfg.steps + 1):
        ids, targets = (t.to(device) for t in next(stream))
        order = list(runs) if step % 2 else list(runs)[::-1]
        for label in order:
            run = runs[label]
            m, opt = run["model"], run["opt"]
            _sync(device)
            if device.type == "cuda":
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = m(ids, targets)
            loss.backward()
            opt.step()
            _sync(device)
            run["seconds"] += time.perf_counter() - t0
            if device.type == "cuda":
                run["peak_mib"] = max(run["peak_mib"], (torch.cuda.max_memory_allocated(device) - base) / 2**20)
            if step % log_every == 0 or step == 1 or step == cfg.steps:
                run["losses"].append((step, loss.item()))
        if step % log_every == 0 or step == 1 or step == cfg.steps:
            progress(step, cfg.steps, {k: v["losses"][-1][1] for k, v in runs.items()})
    sys.stderr.write("\n")
    tokens = cfg.steps * cfg.batch * cfg.seq
    return {label: {"losses": run["losses"], "tokens_per_s": tokens / run["seconds"], "seconds": run["seconds"],
                    "peak_mib": run["peak_mib"]} for label, run in runs.items()}


def plot(out_dir: pathlib.Path, runs: dict, ops: dict, title: str) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots written", file=sys.stderr)
        return []
    def figure(name, ylabel, title_text, draw):
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax)
        ax.set_ylabel(ylabel)
        ax.set_title(title_text)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return str(path)

    def curves(ax):
        for label, run in runs.items():
            steps, losses = zip(*run["losses"])
            ax.plot(steps, losses, label=label, linestyle="-" if label == "opsmith" else "--")
        ax.set_xlabel("step")

    def bars(ax):
        names = list(ops)
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], [ops[n]["opsmith"] for n in names], width=0.4, label="opsmith")
        ax.bar([i + 0.2 for i in xs], [ops[n]["torch"] for n in names], width=0.4, label="PyTorch")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=15)

    written = [figure("loss_curves.png", "training loss (nats/byte)", title, curves),
               figure("op_times.png", "forward+backward ms", "per-op time at the model's shapes", bars)]
    return written


def main(argv=None) -> int:
    parser = Parser(prog="opsmith demo", description="train a small Llama-style model built from opsmith's "
                    "modules beside the same model in plain PyTorch (same seed, same data), print both losses, "
                    "tokens/s, peak memory and per-op times, and plot them; --kernels: the RMSNorm kernel check")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when a GPU is present)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="model size (default: small on cpu, medium on cuda)")
    parser.add_argument("--out", default=os.path.join("build", "demo"), help="where plots and JSON go")
    parser.add_argument("--kernels", action="store_true",
                        help="run the RMSNorm kernel check instead (both routes against float64 PyTorch)")
    args = parser.parse_args(argv)
    from .demo import check_device
    device = check_device(args.device, "opsmith demo")
    if device is None:
        return 2
    if args.kernels:
        from .demo import run_kernel_check
        return run_kernel_check(device)
    if args.steps is not None and args.steps < 1:
        print(f"opsmith demo: --steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    cfg = CONFIGS[args.config or ("medium" if device.type == "cuda" else "small")]
    if args.steps is not None:
        cfg = Config(**{**asdict(cfg), "steps": args.steps})
    if cfg.dtype == "bfloat16" and device.type != "cuda":
        cfg = Config(**{**asdict(cfg), "dtype": "float32"})
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"opsmith demo: a {cfg.layers}-layer Llama-style model (d={cfg.d_model}, {cfg.heads} heads, "
          f"MLP {cfg.intermediate}), {cfg.batch}x{cfg.seq} byte tokens a step, {cfg.steps} steps, {cfg.dtype}, "
          f"on {name}")
    from_torch = [n for n, have in (("rotary", APPLY_ROTARY), ("cross-entropy", CROSS_ENTROPY),
                                    ("fused lm_head + cross-entropy", FUSED_LINEAR_CE), ("AdamW", OPTIM)) if have is None]
    print("opsmith model: fused add + RMSNorm, SwiGLU gated MLP"
          + "".join(f", {n}" for n, have in (("rotary", APPLY_ROTARY), ("cross-entropy", CROSS_ENTROPY),
                                              ("fused lm_head + cross-entropy", FUSED_LINEAR_CE), ("AdamW", OPTIM)) if have is not None)
          + (f"; from PyTorch (not in this build): {', '.join(from_torch)}" if from_torch else ""))
    if device.type == "cpu" and keep_freed_memory():
        print("timings with freed memory kept in the process (glibc mallopt): no page faults of fresh "
              "mappings in either model's numbers")
    log_every = max(1, cfg.steps // 15)
    runs = train(cfg, device, log_every)
    print(f"\n{'step':>6} {'opsmith loss':>13} {'torch loss':>11} {'|diff|':>8}")
    worst = 0.0
    for (step, a), (_, b) in zip(runs["opsmith"]["losses"], runs["torch"]["losses"]):
        worst = max(worst, abs(a - b))
        print(f"{step:>6} {a:>13.4f} {b:>11.4f} {abs(a - b):>8.4f}")
    for label, run in runs.items():
        mem = (f", step peak {run['peak_mib']:.0f} MiB above the model's state" if run["peak_mib"] is not None
               else "")
        print(f"{label:>8}: {run['tokens_per_s']:,.0f} tokens/s ({run['seconds']:.1f} s){mem}")
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    ops = per_op_times(cfg, device, dtype)
    print(f"\nper-op forward+backward at the model's shapes ({cfg.dtype}), ms:")
    print(f"{'op':<24} {'opsmith':>9} {'PyTorch':>9} {'speed-up':>9}")
    for op, t in ops.items():
        print(f"{op:<24} {t['opsmith']:>9.3f} {t['torch']:>9.3f} {t['torch'] / t['opsmith']:>8.2f}x")
    first, last = runs["torch"]["losses"][0][1], runs["torch"]["losses"][-1][1]
    # the two models compute one function; rounding apart, the curves coincide
    tolerance = 0.02 * max(1.0, first) if cfg.dtype == "float32" else 0.1 * max(1.0, first)
    agree = worst <= tolerance
    learned = last < first - 0.5 or cfg.steps < 50
    written = plot(out_dir, runs, ops, f"{cfg.layers}-layer model, {cfg.dtype}, {name}")
    with open(out_dir / "demo.json", "w") as f:
        json.dump({"config": asdict(cfg), "device": name, "torch": torch.__version__, "runs": runs,
                   "per_op_ms": ops, "max_loss_diff": worst, "tolerance": tolerance}, f, indent=1)
    written.append(str(out_dir / "demo.json"))
    print(f"\nlosses agree: max |diff| {worst:.4f} (tolerance {tolerance:.3f})" if agree else
          f"\nLOSSES DISAGREE: max |diff| {worst:.4f} > {tolerance:.3f}")
    if not learned:
        print(f"the loss did not fall ({first:.3f} -> {last:.3f})")
    print("wrote " + ", ".join(written))
    return 0 if agree and learned and all(math.isfinite(l) for _, l in runs["opsmith"]["losses"]) else 1
