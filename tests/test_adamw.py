"""opsmith.adamw_step / adamw_grad_norm and opsmith.optim.AdamW against
torch.optim.AdamW (and torch.nn.utils.clip_grad_norm_): many steps over
param sets of mixed sizes, every option, checkpoints both ways, master
weights, clipping; CUDA cases (skipped without a GPU) add bf16 grads,
misaligned views, thousands of tensors, a tensor of more chunks than one
launch holds and CUDA-graph capture."""
import copy

import pytest
import torch

import opsmith
import opsmith.pybind  # noqa: F401  (route A)
from opsmith.optim import AdamW

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))]
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")

SHAPES = [(37,), (1,), (5, 7), (3, 65), (1000,), (2, 3, 4)]


def make_params(shapes, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]


def set_grads(params, step, scale=1.0, dtype=None, skip=()):
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        gr = torch.randn(p.shape, generator=g) * scale
        p.grad = None if i in skip else gr.to(device=p.device, dtype=dtype or p.dtype)


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def run_pair(ours, theirs, pa, pb, steps, skip=(), clip=None, grad_dtype=None):
    for s in range(steps):
        set_grads(pa, s, dtype=grad_dtype, skip=skip)
        set_grads(pb, s, dtype=grad_dtype, skip=skip)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in pb if p.grad is not None], clip)
        ours.step()
        theirs.step()


def assert_close_params(pa, pb, rtol=None, atol=None):
    # CUDA: torch's kernels contract into FMAs where opsmith's may not
    default = 2e-6 if pa[0].device.type == "cpu" else 1e-5
    rtol = default if rtol is None else rtol
    atol = default if atol is None else atol
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=rtol, atol=atol)


# --- the optimizer against torch.optim.AdamW -------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad,maximize,weight_decay", [(False, False, 0.0), (False, False, 0.1),
                                                           (True, False, 1e-2), (False, True, 1e-2),
                                                           (True, True, 0.0)])
def test_matches_torch_100_steps(device, amsgrad, maximize, weight_decay):
    pa = make_params(SHAPES, device)
    pb = clone_params(pa)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    ours, theirs = AdamW(pa, **kw), torch.optim.AdamW(pb, **kw)
    run_pair(ours, theirs, pa, pb, 100)
    # CPU: a few float32 ulps apart after 100 steps (4.8e-7 seen); CUDA: torch's
    # foreach kernels contract into FMAs differently, so a little more room
    tol = 2e-6 if device == "cpu" else 1e-5
    assert_close_params(pa, pb, rtol=tol, atol=tol)
    for a, b in zip(pa, pb):
        sa, sb = ours.state[a], theirs.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 100.0
        torch.testing.assert_close(sa["exp_avg"].cpu(), sb["exp_avg"].cpu(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sa["exp_avg_sq"].cpu(), sb["exp_avg_sq"].cpu(), rtol=1e-5, atol=1e-7)
        if amsgrad:
            torch.testing.assert_close(sa["max_exp_avg_sq"].cpu(), sb["max_exp_avg_sq"].cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_param_groups_and_missing_grads(device):
    pa = make_params(SHAPES, device)
    pb = clone_params(pa)

    def groups(ps):
        return [{"params": ps[:2], "lr": 3e-2}, {"params": ps[2:4], "weight_decay": 0.0},
                {"params": ps[4:], "lr": 1e-3, "betas": (0.8, 0.95), "amsgrad": True}]

    ours, theirs = AdamW(groups(pa), lr=1e-2), torch.optim.AdamW(groups(pb), lr=1e-2)
    run_pair(ours, theirs, pa, pb, 20, skip=(1, 4))
    assert_close_params(pa, pb)
    # a param whose grad is None is skipped and gets no state, as in torch
    assert len(ours.state[pa[1]]) == 0 and len(theirs.state[pb[1]]) == 0
    assert torch.equal(pa[1].detach().cpu(), pb[1].detach().cpu())
    assert ours.param_groups[0].keys() >= theirs.param_groups[0].keys()


def test_grads_appearing_and_vanishing_between_steps():
    # the per-group lists are reused between steps: they must follow which
    # params have grads, a group added, a state loaded
    pa = make_params(SHAPES, "cpu")
    pb = clone_params(pa)
    ours, theirs = AdamW(pa[:4], lr=1e-2), torch.optim.AdamW(pb[:4], lr=1e-2)
    for s, skip in enumerate([(), (1,), (1,), (0, 2), (), (3,)]):
        set_grads(pa, s, skip=skip), set_grads(pb, s, skip=skip)
        if s == 2:
            ours.param_groups[0]["maximize"] = theirs.param_groups[0]["maximize"] = True
        if s == 4:
            ours.add_param_group({"params": pa[4:], "lr": 3e-3})
            theirs.add_param_group({"params": pb[4:], "lr": 3e-3})
        if s == 5:
            ours.load_state_dict(copy.deepcopy(ours.state_dict()))
        ours.step(), theirs.step()
    assert_close_params(pa, pb)


@pytest.mark.parametrize("reset", ["reassign", "clear_all", "clear_each", "zero_moments", "clear_middle",
                                   "delete_middle", "new_dict_middle", "new_exp_avg_sq_middle"])
def test_state_reset_by_the_caller(reset):
    # a reset of the optimizer's state between steps (a new state dict,
    # every param's state cleared, fresh moments; or one param's, in the
    # middle of the list) is followed, as by torch.optim.AdamW: the reused
    # per-group lists must not keep updating the old tensors
    from collections import defaultdict

    pa = make_params(SHAPES, "cpu")
    pb = clone_params(pa)
    ours, theirs = AdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2)
    for s in range(4):
        set_grads(pa, s), set_grads(pb, s)
        if s == 2:
            for opt in (ours, theirs):
                if reset == "reassign":
                    opt.state = defaultdict(dict)
                elif reset == "clear_all":
                    opt.state.clear()
                elif reset == "clear_each":
                    for p in opt.state:
                        opt.state[p].clear()
                elif reset == "zero_moments":
                    for p in opt.state:
                        opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])
                        opt.state[p]["exp_avg_sq"] = torch.zeros_like(opt.state[p]["exp_avg_sq"])
                else:
                    mid = opt.param_groups[0]["params"][len(SHAPES) // 2]
                    if reset == "clear_middle":
                        opt.state[mid].clear()
                    elif reset == "delete_middle":
                        del opt.state[mid]
                    elif reset == "new_dict_middle":
                        opt.state[mid] = {}
                    else:
                        opt.state[mid]["exp_avg_sq"] = torch.zeros_like(opt.state[mid]["exp_avg_sq"])
        ours.step(), theirs.step()
    assert_close_params(pa, pb)
    for p, q in zip(pa, pb):
        assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"])


def test_state_reset_in_a_group_after_one_rebuilt():
    # one step both rebuilds group 0's buckets (a grad gone) and finds group
    # 1's middle param with a new state dict: group 0's rebuild must not hide
    # group 1's change
    pa = make_params(SHAPES, "cpu")
    pb = clone_params(pa)
    half = len(SHAPES) // 2
    ours = AdamW([{"params": pa[:half]}, {"params": pa[half:]}], lr=1e-2)
    theirs = torch.optim.AdamW([{"params": pb[:half]}, {"params": pb[half:]}], lr=1e-2)
    for s in range(4):
        skip = (0,) if s == 2 else ()
        set_grads(pa, s, skip=skip), set_grads(pb, s, skip=skip)
        if s == 2:
            for opt in (ours, theirs):
                opt.state[opt.param_groups[1]["params"][1]] = {}
        ours.step(), theirs.step()
    assert_close_params(pa, pb)


def test_param_swapped_into_a_group():
    # a param replaced in place in a group's list (the count of params with
    # grads unchanged) is the one stepped, with fresh state, as by torch
    pa = make_params(SHAPES, "cpu")
    pb = clone_params(pa)
    ours, theirs = AdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2)
    for s in range(4):
        if s == 2:
            mid = len(SHAPES) // 2
            for opt, ps in ((ours, pa), (theirs, pb)):
                ps[mid] = torch.nn.Parameter(torch.full_like(ps[mid], 0.5))
                opt.param_groups[0]["params"][mid] = ps[mid]
        set_grads(pa, s), set_grads(pb, s)
        ours.step(), theirs.step()
    assert_close_params(pa, pb)


@pytest.mark.parametrize("device", DEVICES)
def test_lr_as_tensor_and_scheduler(device):
    pa = make_params(SHAPES, device)
    pb = clone_params(pa)
    ours = AdamW(pa, lr=torch.tensor(1e-2, device=device))
    theirs = torch.optim.AdamW(pb, lr=1e-2)
    sa, sb = (torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (ours, theirs))
    for s in range(10):
        set_grads(pa, s), set_grads(pb, s)
        ours.step(), theirs.step()
        sa.step(), sb.step()
    assert_close_params(pa, pb)


@pytest.mark.parametrize("device", DEVICES)
def test_clipping_equals_clip_grad_norm(device):
    pa = make_params(SHAPES, device)
    pb = clone_params(pa)
    ours = AdamW(pa, lr=1e-2, max_grad_norm=0.5)
    theirs = torch.optim.AdamW(pb, lr=1e-2)
    for s in range(20):
        set_grads(pa, s), set_grads(pb, s)
        grads_before = [p.grad.clone() for p in pa]
        norm = torch.nn.utils.clip_grad_norm_(pb, 0.5)
        ours.step(), theirs.step()
        assert ours.last_grad_norm.device == pa[0].device
        torch.testing.assert_close(ours.last_grad_norm.cpu(), norm.cpu(), rtol=1e-6, atol=0)
        # the grads are only read
        assert all(torch.equal(g, p.grad) for g, p in zip(grads_before, pa))
    assert_close_params(pa, pb)


def test_clipping_below_max_norm_is_plain_step():
    pa = make_params(SHAPES, "cpu")
    pb = clone_params(pa)
    ours, theirs = AdamW(pa, lr=1e-2, max_grad_norm=1e6), torch.optim.AdamW(pb, lr=1e-2)
    run_pair(ours, theirs, pa, pb, 5)
    assert_close_params(pa, pb)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_both_ways(device):
    kw = dict(lr=1e-2, weight_decay=0.05, amsgrad=True)
    # torch -> opsmith
    pt = make_params(SHAPES, device)
    torch_opt = torch.optim.AdamW(pt, **kw)
    run_pair(torch_opt, torch_opt, pt, pt, 0)
    for s in range(5):
        set_grads(pt, s)
        torch_opt.step()
    sd = copy.deepcopy(torch_opt.state_dict())
    po = clone_params(pt)
    ours = AdamW(po, **kw)
    ours.load_state_dict(sd)
    assert ours.state[po[0]]["step"].device == po[0].device
    for s in range(5, 10):
        set_grads(pt, s), set_grads(po, s)
        torch_opt.step(), ours.step()
    assert_close_params(po, pt)
    # opsmith -> torch: same keys, loads, and both continue alike
    sd2 = copy.deepcopy(ours.state_dict())
    assert set(sd2["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert set(sd2["state"][0]) == set(torch_opt.state_dict()["state"][0])
    pt2 = clone_params(po)
    torch_opt2 = torch.optim.AdamW(pt2, **kw)
    torch_opt2.load_state_dict(sd2)
    for s in range(10, 15):
        set_grads(pt2, s), set_grads(po, s)
        torch_opt2.step(), ours.step()
    assert_close_params(po, pt2)


def test_master_weights_track_fp32_better_than_bf16():
    # a quadratic pull towards a target at a small lr: each update is below
    # half a bf16 ulp of most weights, so plain bf16 AdamW stalls where the
    # float32 run and the masters move
    shapes = [(64, 33), (257,), (1,)]
    # all three start from the same bf16-representable weights
    ref = [torch.nn.Parameter(p.detach().bfloat16().float()) for p in make_params(shapes, "cpu", seed=3)]
    plain = [torch.nn.Parameter(p.detach().bfloat16()) for p in ref]
    master = [torch.nn.Parameter(p.detach().bfloat16()) for p in ref]
    target = [t.detach() for t in make_params(shapes, "cpu", seed=9)]
    kw = dict(lr=1e-4, weight_decay=0.01)
    o_ref, o_plain = torch.optim.AdamW(ref, **kw), torch.optim.AdamW(plain, **kw)
    o_master = AdamW(master, master_weights=True, **kw)
    for s in range(300):
        for ps in (ref, plain, master):
            for p, t in zip(ps, target):
                p.grad = (p.detach().float() - t).to(p.dtype)
        o_ref.step(), o_plain.step(), o_master.step()

    def mean_err(ps):
        return torch.cat([(a.detach().float() - r.detach()).flatten() for a, r in zip(ps, ref)]).abs().mean().item()

    masters = [o_master.state[p]["master_param"] for p in master]
    err_plain, err_master, err_masters = mean_err(plain), mean_err(master), mean_err(masters)
    # the bf16 params are exactly the rounded masters
    assert all(torch.equal(p.detach(), m.bfloat16()) for p, m in zip(master, masters))
    # masters follow the float32 run closely; plain bf16 AdamW falls behind
    assert err_masters < 0.1 * err_plain, (err_masters, err_plain)
    assert err_master < 0.5 * err_plain, (err_master, err_plain)


def test_bf16_params_without_masters_round_each_step():
    pa = make_params(SHAPES, "cpu", dtype=torch.bfloat16)
    pb = clone_params(pa)
    ours, theirs = AdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2)
    run_pair(ours, theirs, pa, pb, 3)
    # torch keeps bf16 state, opsmith float32: the params agree to bf16 rounding
    assert_close_params(pa, pb, rtol=1.6e-2, atol=1.6e-2)
    assert ours.state[pa[0]]["exp_avg"].dtype == torch.float32


def test_master_weights_checkpoint_roundtrip():
    p = make_params([(40,)], "cpu", dtype=torch.bfloat16)
    o = AdamW(p, lr=1e-3, master_weights=True)
    set_grads(p, 0)
    o.step()
    sd = copy.deepcopy(o.state_dict())
    assert sd["state"][0]["master_param"].dtype == torch.float32
    q = clone_params(p)
    o2 = AdamW(q, lr=1e-3, master_weights=True)
    o2.load_state_dict(sd)
    assert torch.equal(o2.state[q[0]]["master_param"], sd["state"][0]["master_param"])
    assert o2.state[q[0]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_params(device):
    # a transposed param and a sliced one: stepped through contiguous copies
    base = torch.randn(6, 5, device=device)
    wide = torch.randn(4, 9, device=device)
    pa = [torch.nn.Parameter(base.t()), torch.nn.Parameter(wide[:, ::2]), torch.nn.Parameter(torch.randn(7, device=device))]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    assert not pa[0].is_contiguous() and not pa[1].is_contiguous()
    ours, theirs = AdamW(pa, lr=1e-2, max_grad_norm=1.0), torch.optim.AdamW(pb, lr=1e-2)
    for s in range(5):
        set_grads(pa, s), set_grads(pb, s)
        ours.step()
        torch.nn.utils.clip_grad_norm_(pb, 1.0)
        theirs.step()
    assert_close_params(pa, pb)
    assert pa[0].stride() == (1, 5)


def test_torch_checkpoint_into_master_weights():
    # torch's checkpoint of bf16 params (bf16 state, no masters) into master mode:
    # the state becomes float32 and the masters start from the params
    p = make_params([(33,), (4, 5)], "cpu", dtype=torch.bfloat16)
    t = torch.optim.AdamW(p, lr=1e-3)
    set_grads(p, 0)
    t.step()
    q = clone_params(p)
    o = AdamW(q, lr=1e-3, master_weights=True)
    o.load_state_dict(copy.deepcopy(t.state_dict()))
    assert o.param_groups[0]["master_weights"] is True
    st = o.state[q[0]]
    assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["master_param"], q[0].detach().float())
    set_grads(q, 1)
    o.step()
    assert torch.equal(q[0].detach(), o.state[q[0]]["master_param"].bfloat16())


def test_refusals():
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    q.grad = torch.randn(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="params must be float32, bfloat16 or float16"):
        AdamW([q]).step()
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW([torch.nn.Parameter(torch.randn(2))], max_grad_norm=0.0)
    # the bridge names the list and the index
    e = torch.randn(1, 5).expand(3, 5)
    with pytest.raises(RuntimeError, match=r"adamw_step_: params\[0\] has elements that share memory"):
        opsmith.adamw_step([e], [torch.randn(3, 5)], [torch.zeros(3, 5)], [torch.zeros(3, 5)], [torch.ones(())])
    x = [torch.randn(4), torch.randn(3)]
    st = [torch.ones(()), torch.ones(())]
    with pytest.raises(RuntimeError, match=r"adamw_step_: grads\[1\] must have the shape of params\[1\] \[3\], got \[2\]"):
        opsmith.adamw_step(x, [torch.randn(4), torch.randn(2)], [torch.zeros(4), torch.zeros(3)],
                           [torch.zeros(4), torch.zeros(3)], st)
    with pytest.raises(RuntimeError, match=r"adamw_step_: exp_avgs\[0\] must be Float \(the optimizer state's dtype\), "
                                           r"got BFloat16"):
        opsmith.adamw_step(x, x, [torch.zeros(4).bfloat16(), torch.zeros(3)], [torch.zeros(4), torch.zeros(3)], st)
    with pytest.raises(RuntimeError, match=r"adamw_step_: grads\[1\] must be Float like grads\[0\], got BFloat16"):
        opsmith.adamw_step(x, [x[0], x[1].bfloat16()], [torch.zeros(4), torch.zeros(3)],
                           [torch.zeros(4), torch.zeros(3)], st)
    with pytest.raises(RuntimeError, match=r"adamw_step_: steps must have one tensor per param \(2\), got 1"):
        opsmith.adamw_step(x, x, [torch.zeros(4), torch.zeros(3)], [torch.zeros(4), torch.zeros(3)], st[:1])
    with pytest.raises(RuntimeError, match=r"adamw_grad_norm: max_norm must be > 0"):
        opsmith.adamw_grad_norm(x, 0.0)
    # empty lists: a step over nothing does nothing; a norm of nothing has no device to live on
    for step, norm in ((opsmith.adamw_step, opsmith.adamw_grad_norm),
                       (opsmith.pybind.adamw_step, opsmith.pybind.adamw_grad_norm)):
        assert step([], [], [], [], []) is None
        with pytest.raises(RuntimeError, match=r"adamw_grad_norm: grads must not be empty"):
            norm([], 1.0)


# --- the functional ops ------------------------------------------------------------

def _functional_inputs(device, pdt=torch.float32, gdt=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37,), (1,), (70000,), (3, 5)]
    mk = lambda s, dt: torch.randn(s, generator=g).to(device=device, dtype=dt)  # noqa: E731
    ps = [mk(s, pdt) for s in shapes]
    gs = [mk(s, gdt) for s in shapes]
    ms = [mk(s, torch.float32) * 0.1 for s in shapes]
    vs = [mk(s, torch.float32).abs() * 0.01 for s in shapes]
    xs = [v * 1.5 for v in vs]
    steps = [torch.tensor(float(i + 2), device=device) for i in range(len(shapes))]
    return ps, gs, ms, vs, xs, steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16])
def test_functional_against_float64(device, gdt):
    ps, gs, ms, vs, xs, steps = _functional_inputs(device, gdt=gdt)
    ref = [[t.double().cpu() for t in lst] for lst in (ps, gs, ms, vs, xs)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    norm, coef = opsmith.adamw_grad_norm(gs, 1.0)
    opsmith.adamw_step(ps, gs, ms, vs, steps, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, amsgrad=True,
                       max_exp_avg_sqs=xs, clip_coef=coef)
    rn = torch.sqrt(sum((g * g).sum() for g in ref[1]))
    assert abs(norm.item() - rn.item()) <= 1e-5 * rn.item()
    c = min(1.0, 1.0 / (rn.item() + 1e-6))
    assert abs(coef.item() - c) <= 1e-5 * c
    for i, (p, g, m, v, x) in enumerate(zip(*ref)):
        s = float(steps[i])
        g = g * c
        p = p * (1 - lr * wd)
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        x = torch.maximum(x, v)
        p = p - lr / (1 - b1 ** s) * m / (x.sqrt() / (1 - b2 ** s) ** 0.5 + eps)
        torch.testing.assert_close(ps[i].cpu().double(), p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ms[i].cpu().double(), m, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(vs[i].cpu().double(), v, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(xs[i].cpu().double(), x, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_route_a_equals_route_b(device):
    a = _functional_inputs(device, pdt=torch.bfloat16, gdt=torch.bfloat16)
    b = [[t.clone() for t in lst] for lst in a]
    wa, wb = [p.float() for p in a[0]], [p.float() for p in b[0]]
    kw = dict(lr=1e-3, weight_decay=0.01, maximize=True)
    opsmith.adamw_step(a[0], a[1], a[2], a[3], a[5], master_params=wa, **kw)
    opsmith.pybind.adamw_step(b[0], b[1], b[2], b[3], b[5], master_params=wb, **kw)
    for x, y in zip(a[0] + a[2] + a[3] + wa, b[0] + b[2] + b[3] + wb):
        assert torch.equal(x, y)
    na, nb = opsmith.adamw_grad_norm(a[1], 1.0), opsmith.pybind.adamw_grad_norm(b[1], 1.0)
    assert torch.equal(na[0], nb[0]) and torch.equal(na[1], nb[1])


def test_opcheck():
    ps, gs, ms, vs, xs, steps = _functional_inputs("cpu")
    torch.library.opcheck(torch.ops.opsmith.adamw_step_.default,
                          (ps, gs, ms, vs, xs, [], steps, 1e-3, None, 0.9, 0.999, 1e-8, 0.01, True, False, None))
    torch.library.opcheck(torch.ops.opsmith.adamw_grad_norm.default, (gs, 1.0))


def test_grad_norm_deterministic_across_threads():
    gs = [torch.randn(n) for n in (70000, 3, 140001)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = opsmith.adamw_grad_norm(gs, 1.0)[0]
        torch.set_num_threads(2)
        b = opsmith.adamw_grad_norm(gs, 1.0)[0]
    finally:
        torch.set_num_threads(old)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_increment_steps_in_the_call(device):
    # increment_steps=True: every count advanced by exactly 1 before the
    # update (an empty tensor's too, as torch counts it), the same result
    # as incrementing first and stepping
    a = list(_functional_inputs(device))
    b = [[t.clone() for t in lst] for lst in a]
    for lst in (a, b):
        lst[0].append(torch.empty(0, device=device))
        for k in (1, 2, 3):
            lst[k].append(torch.empty(0, device=device))
        lst[5].append(torch.tensor(4.0, device=device))
    before = [float(s) for s in a[5]]
    opsmith.adamw_step(a[0], a[1], a[2], a[3], a[5], lr=1e-2, increment_steps=True)
    for s in b[5]:
        s += 1
    opsmith.adamw_step(b[0], b[1], b[2], b[3], b[5], lr=1e-2)
    assert [float(s) for s in a[5]] == [x + 1 for x in before]
    for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3]):
        assert torch.equal(x, y)
    c = [[t.clone() for t in lst] for lst in b]
    opsmith.pybind.adamw_step(c[0], c[1], c[2], c[3], c[5], lr=1e-2, increment_steps=True)
    opsmith.adamw_step(b[0], b[1], b[2], b[3], b[5], lr=1e-2, increment_steps=True)
    for x, y in zip(b[0] + b[5], c[0] + c[5]):
        assert torch.equal(x, y)


def test_step_is_not_differentiable_and_bumps_versions():
    ps, gs, ms, vs, xs, steps = _functional_inputs("cpu")
    leaf = [p.clone().requires_grad_() for p in ps]
    with pytest.raises(RuntimeError, match=r"adamw_step_: params\[0\] requires grad and grad mode is on"):
        opsmith.adamw_step(leaf, gs, ms, vs, steps)
    versions = [t._version for t in ps + ms + vs + steps]
    with torch.no_grad():
        opsmith.adamw_step(leaf, gs, ms, vs, steps, increment_steps=True)
    opsmith.adamw_step(ps, gs, ms, vs, steps, increment_steps=True)
    assert all(t._version > v for t, v in zip(ps + ms + vs + steps, versions))
    # the unboxed Autograd kernel, not PyTorch's boxed fallback, serves the op
    # (the fallback costs most of a step's host time over thousands of tensors)
    for name in ("opsmith::adamw_step_", "opsmith::adamw_grad_norm"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"), name


def test_compiled_step_fullgraph():
    ps, gs, ms, vs, xs, steps = _functional_inputs("cpu")
    qs = [[t.clone() for t in lst] for lst in (ps, ms, vs)]

    def f(p, g, m, v, s):
        n, c = opsmith.adamw_grad_norm(g, 0.5)
        opsmith.adamw_step(p, g, m, v, s, lr=1e-2, clip_coef=c)
        return n

    n1 = torch.compile(f, fullgraph=True)(ps, gs, ms, vs, steps)
    n2 = f(qs[0], gs, qs[1], qs[2], steps)
    assert torch.equal(n1, n2)
    assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs, qs[0] + qs[1] + qs[2]))


# --- CUDA only ------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("pdt,gdt,master", [(torch.float32, torch.bfloat16, False),
                                            (torch.bfloat16, torch.bfloat16, True),
                                            (torch.bfloat16, torch.float32, True),
                                            (torch.float16, torch.float16, False)])
def test_cuda_matches_cpu_every_dtype(pdt, gdt, master):
    cpu = _functional_inputs("cpu", pdt=pdt, gdt=gdt, seed=4)
    dev = [[t.cuda() for t in lst] for lst in cpu]
    masters = []
    for (ps, gs, ms, vs, xs, steps) in (cpu, dev):
        ws = [p.float() for p in ps] if master else None
        masters.append(ws)
        n, c = opsmith.adamw_grad_norm(gs, 2.0)
        opsmith.adamw_step(ps, gs, ms, vs, steps, lr=1e-2, weight_decay=0.1, amsgrad=True, max_exp_avg_sqs=xs,
                           master_params=ws, clip_coef=c)
    # float32 results agree to float32 rounding; a 16-bit param to its own
    # rounding (an ulp of float32 apart can round to neighbouring bf16 values)
    tol = dict(rtol=1e-5, atol=1e-6) if pdt == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(cpu[0], dev[0]):
        torch.testing.assert_close(b.cpu().float(), a.float(), **tol)
    if master:
        for a, b, w in zip(masters[0], masters[1], dev[0]):
            torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
            assert torch.equal(w, b.to(pdt)), "params are the rounded masters"
    for a, b in zip(cpu[2] + cpu[3] + cpu[4], dev[2] + dev[3] + dev[4]):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-7)


@needs_cuda
def test_cuda_misaligned_views_and_many_tensors():
    # 3000 tensors (several launches' worth of tensor slots) carved out of one
    # buffer at odd offsets: contiguous, but not 16-byte aligned (scalar path)
    g = torch.Generator().manual_seed(7)
    sizes = [int(x) for x in torch.randint(1, 3000, (3000,), generator=g)]
    total = sum(sizes) + 3000
    flat = torch.randn(total, generator=g).cuda()
    views, at = [], 1
    for n in sizes:
        views.append(flat[at:at + n])
        at += n + 1
    pa = [torch.nn.Parameter(v) for v in views]
    pb = [torch.nn.Parameter(v.detach().clone()) for v in views]
    ours, theirs = AdamW(pa, lr=1e-2, max_grad_norm=1.0), torch.optim.AdamW(pb, lr=1e-2, fused=True)
    for s in range(3):
        set_grads(pa, s), set_grads(pb, s)
        torch.nn.utils.clip_grad_norm_(pb, 1.0)
        ours.step(), theirs.step()
    assert_close_params(pa, pb, rtol=1e-5, atol=1e-5)


def captured_step(optimizer):
    """optimizer.step() captured in a CUDA graph (on a side stream, as torch requires)"""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            optimizer.step()
    torch.cuda.current_stream().wait_stream(s)
    return graph


@needs_cuda
def test_cuda_overlapped_launches_in_a_graph_then_read_at_once():
    # 1500 aligned tensors (four launches, which overlap on sm_90), one of them
    # larger than a chunk, stepped in a CUDA graph; every parameter is read by
    # the very next kernel on the stream (no synchronisation in between)
    g = torch.Generator().manual_seed(11)
    sizes = [int(x) for x in torch.randint(1, 4000, (1500,), generator=g)] + [3 * 8192 + 5]
    pa = [torch.nn.Parameter(torch.randn(n, generator=g).cuda()) for n in sizes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ours = AdamW(pa, lr=1e-2, capturable=True)
    theirs = torch.optim.AdamW(pb, lr=1e-2, fused=True)
    grads = [torch.randn(n, generator=g).cuda() for n in sizes]
    for p, q, gr in zip(pa, pb, grads):
        p.grad, q.grad = gr.clone(), gr.clone()
    ours.step(), theirs.step()  # state made outside the graph
    graph = captured_step(ours)
    for _ in range(4):
        graph.replay()
        flat_ours = torch.cat([p.detach() for p in pa])  # right behind the replay
        theirs.step()
        flat_theirs = torch.cat([p.detach() for p in pb])
        torch.testing.assert_close(flat_ours, flat_theirs, rtol=1e-5, atol=1e-5)


@needs_cuda
def test_cuda_tensor_of_2400_chunks():
    # 157M elements in one tensor: 19200 blocks of one launch, 64-bit offsets
    n = 2400 * 65536 + 17
    p = torch.randn(n, device="cuda")
    q = p.clone()
    grad = torch.randn(n, device="cuda")
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step = torch.ones((), device="cuda")
    norm, coef = opsmith.adamw_grad_norm([grad], 100.0)
    opsmith.adamw_step([p], [grad], [m], [v], [step], lr=1e-2, clip_coef=coef)
    ref = torch.linalg.vector_norm(grad.double())
    assert abs(norm.item() - ref.item()) <= 1e-5 * ref.item()
    c = min(1.0, 100.0 / (ref.item() + 1e-6))
    gq = grad * c
    mq = 0.1 * gq
    vq = 0.001 * gq * gq
    q = q * (1 - 1e-4) - 1e-2 / 0.1 * mq / (vq.sqrt() / 0.001 ** 0.5 + 1e-8)
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m, mq, rtol=1e-5, atol=1e-7)


@needs_cuda
def test_cuda_graph_capture_with_tensor_lr():
    pa = make_params(SHAPES, "cuda")
    pb = clone_params(pa)
    lr = torch.tensor(1e-2, device="cuda")
    ours = AdamW(pa, lr=lr, max_grad_norm=0.5, capturable=True)
    theirs = torch.optim.AdamW(pb, lr=1e-2)
    set_grads(pa, 0)
    ours.step()  # state made outside the graph
    static_grads = [p.grad for p in pa]
    graph = captured_step(ours)
    set_grads(pb, 0)
    torch.nn.utils.clip_grad_norm_(pb, 0.5)
    theirs.step()
    for st in range(1, 6):
        if st == 3:
            lr.fill_(5e-3)
            for group in theirs.param_groups:
                group["lr"] = 5e-3
        set_grads(pb, st)
        g = torch.Generator().manual_seed(1000 + st)
        for sg, p in zip(static_grads, pb):
            sg.copy_(torch.randn(p.shape, generator=g))
        graph.replay()
        torch.nn.utils.clip_grad_norm_(pb, 0.5)
        theirs.step()
    torch.cuda.synchronize()
    assert_close_params(pa, pb, rtol=1e-5, atol=1e-5)


@needs_cuda
def test_cuda_grad_norm_of_overlapped_launches_in_a_graph():
    # 5000 aligned grads (four launches of the norm, which overlap on sm_90),
    # many of them whole chunks and tails: the norm against float64, captured
    # in a CUDA graph and replayed after the grads change in place, each
    # result read by the very next kernel on the stream
    g = torch.Generator().manual_seed(13)
    sizes = [int(x) for x in torch.randint(1, 20000, (5000,), generator=g)]
    grads = [torch.randn(n, generator=g).cuda() for n in sizes]

    def want():
        return torch.linalg.vector_norm(torch.cat(grads).double()).item()

    norm, coef = opsmith.adamw_grad_norm(grads, 1.0)
    assert abs(norm.item() - want()) <= 1e-5 * want()
    assert abs(coef.item() - min(1.0, 1.0 / (want() + 1e-6))) <= 1e-5 * coef.item()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            gnorm, _ = opsmith.adamw_grad_norm(grads, 1.0)
    torch.cuda.current_stream().wait_stream(s)
    for scale in (0.5, 3.0):
        for gr in grads:
            gr.mul_(scale)
        graph.replay()
        got = gnorm * 1.0  # right behind the replay
        assert abs(got.item() - want()) <= 1e-5 * want(), scale


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_grad_norm_of_a_tensor_past_two_to_the_28(dtype):
    # an embedding's gradient (Llama 3 8B: 525M elements) is longer than the
    # norm's 2^28-element table slot: it takes several, beside tensors of 1 to
    # 7 elements and a misaligned view; against float64, and the only nonzero
    # element past the first slot still counts
    n = (1 << 28) + 4099
    big = torch.randn(n, device="cuda", dtype=dtype) * 1e-3
    big[-1] = 20.0
    small = [torch.randn(k, device="cuda", dtype=dtype) for k in range(1, 8)]
    view = torch.randn(1001, device="cuda", dtype=dtype)[1:]
    grads = small[:3] + [big] + small[3:] + [view]
    want = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    norm, _ = opsmith.adamw_grad_norm(grads, 1.0)
    assert abs(norm.item() - want) <= 1e-5 * want
    big[-1] = 0.0
    want0 = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    assert want0 < want - 1.0
    assert abs(opsmith.adamw_grad_norm(grads, 1.0)[0].item() - want0) <= 1e-5 * want0


def test_copies_keep_clipping():
    # deepcopy, pickle and torch.save of the optimizer: the copy clips as the
    # original does (torch's Optimizer pickles only defaults, state, groups)
    import io
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1)
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    opt.zero_grad()  # a copied Parameter has no .grad
    buf = io.BytesIO()
    torch.save({"model": model, "opt": opt}, buf)
    copies = [copy.deepcopy({"model": model, "opt": opt}), pickle.loads(pickle.dumps({"model": model, "opt": opt})),
              (buf.seek(0), torch.load(buf, weights_only=False))[1]]
    x = torch.randn(4, 16)
    model(x).square().sum().backward()
    opt.step()
    for c in copies:
        assert c["opt"].max_grad_norm == 0.1
        c["model"](x).square().sum().backward()
        c["opt"].step()
        for a, b in zip(c["model"].parameters(), model.parameters()):
            assert torch.equal(a, b)


def test_params_converted_to_another_dtype_between_steps():
    # module.to(dtype) keeps the param objects: the next step must see the
    # new dtype (a master_weights group needs float32 masters for bfloat16)
    torch.manual_seed(0)
    models = [torch.nn.Linear(32, 16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [AdamW(m.parameters(), lr=1e-3, master_weights=True) for m in models]
    x = torch.randn(8, 32)
    for step in range(3):
        if step == 1:
            for m in models:
                m.to(torch.bfloat16)
        for m, o in zip(models, opts):
            m(x.to(m.weight.dtype)).float().square().sum().backward()
            if o is opts[1]:
                o._bucket_cache.clear()  # the reference: every step's buckets made anew
            o.step()
            o.zero_grad()
    assert all("master_param" in opts[0].state[p] for p in models[0].parameters())
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
