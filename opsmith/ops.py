"""Route B, the functional API: wrappers over torch.ops.opsmith.*, with the
fake (shape-only) kernel registered beside each op so the ops work under
torch.compile and FakeTensor. Autograd is registered in C++ with the ops."""
from typing import Optional

import torch

from . import _library  # noqa: F401  (loads the library: torch.ops.opsmith.* exists after this)

_ops = torch.ops.opsmith
# the overloads themselves: calling them skips the packet's overload lookup
_rms_norm_fwd = _ops.rms_norm_fwd.default


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- rms_norm ----------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None) -> torch.Tensor:
    """RMSNorm over the last dimension of x:
    ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    Same result as ``torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)``;
    eps None means ``torch.finfo(x.dtype).eps``. x and weight share device and
    dtype (float64, float32, float16, bfloat16); sums run in float32 (float64
    for float64)."""
    return _rms_norm_fwd(x, weight, eps)[0]


@torch.library.register_fake("opsmith::rms_norm_fwd")
def _rms_norm_fwd_fake(x, weight, eps=None):
    torch._check(x.dim() >= 1, lambda: "rms_norm: x must have at least 1 dimension")
    if weight is not None:
        torch._check(weight.shape == x.shape[-1:],
                     lambda: f"rms_norm: weight must have shape {list(x.shape[-1:])}, got {list(weight.shape)}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    inv_rms = torch.empty(x.shape[:-1], dtype=_accumulate_dtype(x.dtype), device=x.device)
    return y, inv_rms


@torch.library.register_fake("opsmith::rms_norm_bwd")
def _rms_norm_bwd_fake(dy, x, weight, inv_rms):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty((x.shape[-1] if weight is not None else 0,), dtype=x.dtype, device=x.device)
    return dx, dweight

# Autograd for rms_norm_fwd is registered in C++ (csrc/torch/ops.cpp): the
# backward calls rms_norm_bwd with the saved x, weight and inv_rms.
