"""opsmith.optim.AdamW: a drop-in for torch.optim.AdamW whose step is one
multi-tensor C/CUDA launch per param group (opsmith.adamw_step), with
optional global gradient-norm clipping fused into it (max_grad_norm).

Same constructor, param groups and state_dict layout as torch.optim.AdamW
(state keys 'step', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'), so a
checkpoint moves between the two both ways. The differences:

* state lives on the param's device, 'step' included (as with
  torch.optim.AdamW(fused=True)), and exp_avg / exp_avg_sq /
  max_exp_avg_sq are float32 whatever the param dtype;
* master_weights=True keeps a float32 copy of every 16-bit param in the
  state under 'master_param'; the update runs on it and the param receives
  it rounded;
* max_grad_norm clips by the global norm of all grads (as
  torch.nn.utils.clip_grad_norm_ over every param of the optimizer) inside
  the step, without rewriting the grads and without a host synchronisation;
  the norm is kept as a device tensor in ``optimizer.last_grad_norm``;
* params are float32, bfloat16 or float16, grads dense; a non-contiguous
  param (a transposed or sliced view) is stepped through a contiguous copy
  (correct, slower).

A float lr is passed to the kernel as a number; an lr given as a float32
scalar tensor on the params' device is read by the kernel, which makes the
whole step capturable in a CUDA graph with a changing lr (capturable is
accepted for compatibility: nothing here synchronises with the host)."""
from collections import defaultdict
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .ops.adamw import adamw_grad_norm, adamw_step

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
# a bucket's lists of state tensors, by the state key each came from
_STATE_FIELDS = (("m", "exp_avg"), ("v", "exp_avg_sq"), ("x", "max_exp_avg_sq"), ("w", "master_param"),
                 ("s", "step"))


class _StateTable(defaultdict):
    """optimizer.state as this optimizer makes it: a defaultdict(dict) that
    counts the changes to its own entries (a param's state dict set or
    deleted, the table cleared), so a step tells in O(1) that every param's
    state dict is the one its buckets hold. A table the caller assigns
    (opt.state = defaultdict(dict)) is checked param by param instead."""
    changes = 0

    def _changed(self):
        self.changes += 1

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def __ior__(self, other):
        self._changed()
        return super().__ior__(other)

    def clear(self):
        super().clear()
        self._changed()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._changed()


def _table(state) -> "_StateTable":
    return state if isinstance(state, _StateTable) else _StateTable(dict, state)


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, capturable=False, master_weights=False, max_grad_norm=None, foreach=None,
                 differentiable=False, fused=None):
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be > 0, or None for no clipping)")
        if differentiable:
            raise RuntimeError("opsmith.optim.AdamW: differentiable=True is not supported")
        # torch.optim.AdamW's group keys, so a state_dict loads into either
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=False, fused=fused,
                        decoupled_weight_decay=True, master_weights=master_weights)
        super().__init__(params, defaults)
        self.state = _table(self.state)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Optional[Tensor] = None
        # per group: the lists of the last step's buckets (see _buckets)
        self._bucket_cache: Dict[int, Any] = {}
        self._state_version = 0

    def __getstate__(self):
        # torch's Optimizer pickles defaults, state and param_groups: clipping
        # is this class's own and must survive deepcopy, pickle and torch.save
        return {**super().__getstate__(), "max_grad_norm": self.max_grad_norm}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__["state"] = _table(self.__dict__["state"])
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("master_weights", False)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("last_grad_norm", None)
        self.__dict__["_bucket_cache"] = {}
        self.__dict__["_state_version"] = self.__dict__.get("_state_version", 0) + 1

    def _init_state(self, p: Tensor, group) -> Dict[str, Any]:
        state = self.state[p]
        if len(state) == 0 or "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if group["master_weights"] and p.dtype != torch.float32 and "master_param" not in state:
            state["master_param"] = p.detach().float()
        return state

    @staticmethod
    def _check_param(p: Tensor):
        if p.grad.is_sparse:
            raise RuntimeError("opsmith.optim.AdamW does not support sparse gradients")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RuntimeError(f"opsmith.optim.AdamW: params must be float32, bfloat16 or float16, got {p.dtype}")

    def _clip_coef(self, plans) -> Optional[Tensor]:
        """The fused global norm over every grad of every group (one launch
        per device and grad dtype), kept in last_grad_norm; the clip
        coefficient as a device tensor."""
        if self.max_grad_norm is None:
            return None
        by: Dict[Any, List[Tensor]] = {}
        for _, b, grads in plans:
            by.setdefault((b["device"], b["grad_dtype"]), []).extend(grads)
        if not by:
            return None
        parts = [adamw_grad_norm(gs, self.max_grad_norm) for gs in by.values()]
        if len(parts) == 1:
            self.last_grad_norm, coef = parts[0]
            return coef
        # several devices or dtypes: combine the norms on the first device
        dev = parts[0][0].device
        norm = torch.stack([n.to(dev) for n, _ in parts]).square().sum().sqrt()
        self.last_grad_norm = norm
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def _state_still(self, cached) -> bool:
        """Whether self.state still holds a group's cached buckets' state:
        each param's state dict (opt.state[p] = {...}, del opt.state[p], a
        new opt.state: the table's change count since the group's check, or
        param by param when it moved or the caller assigned the table) and
        in it each tensor the buckets step (.clear(), a fresh exp_avg). A
        state changed for any param, the first or the thousandth, makes the
        buckets again; so does a param whose dtype changed (module.to(dtype)
        keeps the param objects: a master_weights group then needs masters
        it did not). Passes over the lists through map (no Python loop a
        param)."""
        _, buckets, table, changes = cached
        state = self.state
        now = getattr(state, "changes", None)
        if not (now is not None and state is table and now == changes):
            get = state.get
            if not all(all(map(is_, map(get, b["p"]), b["d"])) for b in buckets):
                return False
            cached[2], cached[3] = state, now  # checked at this count
        dtype = attrgetter("dtype")
        for b in buckets:
            if not all(map(is_, map(dtype, b["p"]), repeat(b["dtype"]))):
                return False
            for field, key in _STATE_FIELDS:
                if b[field] and not all(map(is_, map(dict.get, b["d"], repeat(key)), b[field])):
                    return False
        return True

    def _buckets(self, gi: int, group) -> List[Dict[str, Any]]:
        """The group's params with grads, split by (device, param dtype, grad
        dtype, master or not), with their state lists. Built (state made,
        params checked) when the group's set of params with grads or its
        options change, else reused: a step over thousands of tensors then
        costs two list comprehensions of host time, not a loop of lookups."""
        params = group["params"]
        # which params, by identity (a param swapped into the group), have grads
        with_grad = [p.grad is not None and id(p) for p in params]
        key = (with_grad, group["amsgrad"], group["master_weights"], self._state_version)
        cached = self._bucket_cache.get(gi)
        if cached is not None and cached[0] == key and self._state_still(cached):
            return cached[1]
        by_key: Dict[Any, Dict[str, Any]] = {}
        for p, g in zip(params, with_grad):
            if g is False:
                continue
            self._check_param(p)
            state = self._init_state(p, group)
            master = state.get("master_param") if group["master_weights"] else None
            b = by_key.setdefault((p.device, p.dtype, p.grad.dtype, master is not None),
                                  {"p": [], "d": [], "m": [], "v": [], "x": [], "w": [], "s": []})
            b["p"].append(p)
            b["d"].append(state)
            b["m"].append(state["exp_avg"])
            b["v"].append(state["exp_avg_sq"])
            if group["amsgrad"]:
                b["x"].append(state["max_exp_avg_sq"])
            if master is not None:
                b["w"].append(master)
            b["s"].append(state["step"])
        buckets = []
        for (device, dtype, grad_dtype, has_master), b in by_key.items():
            b["device"], b["dtype"], b["grad_dtype"], b["has_master"] = device, dtype, grad_dtype, has_master
            buckets.append(b)
        # the table and its change count the buckets' state dicts were read at (_state_still)
        self._bucket_cache[gi] = [key, buckets, self.state, getattr(self.state, "changes", None)]
        return buckets

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = [(group, b, [p.grad for p in b["p"]])
                 for gi, group in enumerate(self.param_groups) for b in self._buckets(gi, group)]
        coef = self._clip_coef(plans)
        for group, b, grads in plans:
            beta1, beta2 = group["betas"]
            device = b["device"]
            lr = group["lr"]
            if isinstance(lr, Tensor) and (lr.device != device or lr.dtype != torch.float32):
                lr = lr.to(device=device, dtype=torch.float32)
            c = coef
            if c is not None and c.device != device:
                c = c.to(device)
            # non-contiguous grads: the bridge reads them through contiguous copies
            adamw_step(b["p"], grads, b["m"], b["v"], b["s"], lr=lr, beta1=beta1,
                       beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                       amsgrad=group["amsgrad"], maximize=group["maximize"],
                       max_exp_avg_sqs=b["x"] if group["amsgrad"] else None,
                       master_params=b["w"] if b["has_master"] else None, clip_coef=c, increment_steps=True)
        return loss

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        self.__dict__.setdefault("_bucket_cache", {})
        self.__dict__["_state_version"] = self.__dict__.get("_state_version", 0) + 1

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state_dict of this class or of torch.optim.AdamW: the
        state is moved to each param's device in float32 (torch's loader
        would cast it to the param's dtype), and the masters of a
        master_weights group that the checkpoint lacks start from the
        params."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        # a torch.optim.AdamW checkpoint has no master_weights: keep this optimizer's
        ours = [{k: g[k] for k in ("master_weights",) if k not in saved_g}
                for g, saved_g in zip(self.param_groups, state_dict["param_groups"])]
        super().load_state_dict(state_dict)
        for g, keep in zip(self.param_groups, ours):
            g.update(keep)
        for i, p in zip(ids, params):
            if i not in saved:
                continue
            src, state = saved[i], self.state[p]
            for k, v in src.items():
                if k == "step":
                    state[k] = torch.as_tensor(v, dtype=torch.float32).reshape(()).to(p.device).clone()
                elif k in _STATE_KEYS and isinstance(v, Tensor):
                    state[k] = v.to(device=p.device, dtype=torch.float32, copy=True)
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    self._init_state(p, group)
