"""Modules over the functional API, drop-in replacements for their PyTorch
counterparts: same constructor arguments, parameter names and state-dict keys."""
import numbers
from typing import Optional, Tuple, Union

import torch

from .ops import rms_norm


class RMSNorm(torch.nn.Module):
    """Drop-in for torch.nn.RMSNorm, computed by opsmith's kernels."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: Tuple[int, ...]
    eps: Optional[float]
    elementwise_affine: bool

    def __init__(self, normalized_shape: Union[int, Tuple[int, ...], torch.Size],
                 eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(
                torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != self.normalized_shape:
            raise RuntimeError(
                f"RMSNorm: expected input with shape [*, {', '.join(map(str, self.normalized_shape))}], "
                f"got {list(x.shape)}")
        if k == 1:
            return rms_norm(x, self.weight, self.eps)
        # normalize over the last k dims as one flattened dim
        weight = self.weight.reshape(-1) if self.weight is not None else None
        return rms_norm(x.flatten(-k), weight, self.eps).view(x.shape)

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            **self.__dict__)
