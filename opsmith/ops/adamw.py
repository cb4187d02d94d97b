"""AdamW in Python: the functional multi-tensor step (route B), the fused
global gradient norm, their fake kernels, and route A. The optimizer built on
them is opsmith.optim.AdamW. The dispatcher imports this module for the fake
kernels when the library is loaded on its own (m.set_python_module in
csrc/torch/adamw.cpp)."""
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)
from . import route_a

_step = torch.ops.opsmith.adamw_step_.default
_grad_norm = torch.ops.opsmith.adamw_grad_norm.default


def _lr_args(lr):
    if isinstance(lr, Tensor):
        return -1.0, lr
    return float(lr), None


def adamw_step(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], *, lr: Union[float, Tensor] = 1e-3,
               beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
               amsgrad: bool = False, maximize: bool = False,
               max_exp_avg_sqs: Optional[Sequence[Tensor]] = None,
               master_params: Optional[Sequence[Tensor]] = None,
               clip_coef: Optional[Tensor] = None, increment_steps: bool = False) -> None:
    """One AdamW step over lists of tensors, in place, in one multi-tensor
    launch (a handful for thousands of tensors): torch.optim.AdamW's update
    (decoupled weight decay, bias correction from each tensor's step count).

    params: float32, bfloat16 or float16, contiguous; grads: float32,
    bfloat16 or float16 (one dtype per list), only read; exp_avgs,
    exp_avg_sqs, max_exp_avg_sqs (amsgrad) and master_params: float32.
    steps: one float32 scalar tensor per param on its device, the step count
    AFTER this step's increment: the caller increments them, as torch does,
    or passes increment_steps=True and the op adds 1 to each first (in the
    same call: no separate pass over the list).
    master_params (16-bit params): the update runs on the float32 masters
    and the params receive the rounded masters. lr may be a float32 scalar
    tensor on the params' device; clip_coef, a float32 scalar tensor that
    scales every gradient (adamw_grad_norm's second result). Neither is read
    on the host, so the step can be captured in a CUDA graph."""
    params = list(params)
    if not params and not any((grads, exp_avgs, exp_avg_sqs, steps)):
        return  # nothing to step (the dispatcher needs a tensor to choose a device)
    lr_f, lr_t = _lr_args(lr)
    _step(params, list(grads), list(exp_avgs), list(exp_avg_sqs),
          list(max_exp_avg_sqs) if amsgrad and max_exp_avg_sqs is not None else [],
          list(master_params) if master_params is not None else [], list(steps),
          lr_f, lr_t, float(beta1), float(beta2), float(eps), float(weight_decay), bool(amsgrad), bool(maximize),
          clip_coef, bool(increment_steps))


def adamw_grad_norm(grads: Sequence[Tensor], max_norm: float) -> Tuple[Tensor, Tensor]:
    """(norm, clip_coef): the global L2 norm of all grads, computed in one
    multi-tensor pass (per-chunk sums of squares summed in a fixed order:
    deterministic), and min(1, max_norm / (norm + 1e-6)), the factor
    torch.nn.utils.clip_grad_norm_ scales by. Both float32 scalar tensors on
    the grads' device, never read on the host. One grad dtype per call."""
    grads = list(grads)
    if not grads:
        raise RuntimeError("adamw_grad_norm: grads must not be empty (the norm needs a device)")
    return _grad_norm(grads, float(max_norm))


@torch.library.register_fake("opsmith::adamw_step_")
def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, lr, lr_tensor,
                     beta1, beta2, eps, weight_decay, amsgrad, maximize, clip_coef, increment_steps=False):
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
        torch._check(len(lst) == n, lambda: f"adamw_step_: {name} must have one tensor per param ({n}), got {len(lst)}")
    return None


@torch.library.register_fake("opsmith::adamw_grad_norm")
def _adamw_grad_norm_fake(grads, max_norm):
    torch._check(len(grads) > 0, lambda: "adamw_grad_norm: grads must not be empty (the norm needs a device)")
    d = grads[0].device
    return (torch.empty((), dtype=torch.float32, device=d), torch.empty((), dtype=torch.float32, device=d))


# --- route A -----------------------------------------------------------------------

def adamw_step_pybind(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=1e-2, amsgrad=False, maximize=False, max_exp_avg_sqs=None, master_params=None,
                      clip_coef=None, increment_steps=False) -> None:
    """adamw_step through route A (pybind11): the same bridge and kernels."""
    lr_f, lr_t = _lr_args(lr)
    route_a().adamw_step_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                          list(max_exp_avg_sqs) if amsgrad and max_exp_avg_sqs is not None else [],
                          list(master_params) if master_params is not None else [], list(steps),
                          lr_f, lr_t, float(beta1), float(beta2), float(eps), float(weight_decay), bool(amsgrad),
                          bool(maximize), clip_coef, bool(increment_steps))


def adamw_grad_norm_pybind(grads, max_norm):
    """adamw_grad_norm through route A (pybind11)."""
    return route_a().adamw_grad_norm(list(grads), float(max_norm))


FUNCTIONS = {"adamw_step": adamw_step, "adamw_grad_norm": adamw_grad_norm}
PYBIND = {"adamw_step": adamw_step_pybind, "adamw_grad_norm": adamw_grad_norm_pybind}
