"""LePE beside the kernels: PyTorch's depthwise convolution (cuDNN on a GPU) inside the kernels' autograd functions.

The forward adds it to the output in place (``mhla.fused.lepe_forward_``, the torch path's); the backward adds
v's gradient into the kernels' gradient buffer in place, so that LePE costs its two convolutions and no copy.
"""
import torch

from ..fused import lepe_backward_

__all__ = ["lepe_gradients", "values"]


def values(qkv: torch.Tensor) -> torch.Tensor:
    """v of ``qkv`` ``[B, N, 3C]`` as ``[B, N, C]`` (a view)."""
    return qkv.unflatten(-1, (3, -1))[:, :, 2]


def lepe_gradients(grad: torch.Tensor, grad_out: torch.Tensor, qkv: torch.Tensor, weight: torch.Tensor | None,
                   has_bias: bool, grid_size: tuple[int, int] | None, needs: tuple[bool, bool]) -> tuple:
    """LePE's backward: v's gradient added into ``grad`` ``[B, N, 3, C]`` (its v slot); returns the gradients of
    the weight and the bias in the weight's dtype (None where there is no LePE or ``needs`` says False)."""
    if weight is None:
        return None, None
    grads = lepe_backward_(grad[:, :, 2], grad_out, values(qkv), weight, has_bias, grid_size, needs)
    return tuple(None if g is None else g.to(weight.dtype) for g in grads)
