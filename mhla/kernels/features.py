"""The feature map on load, shared by the kernels: ``phi = ReLU(RMSNorm(x) w) + feature_eps`` for q and k.

RMSNorm normalises each token over all C channels, across the heads, while a kernel's program sees one
head's D columns: the per-token statistic ``r = (mean(x^2) + eps)^(-1/2)`` of q and k is computed once
beforehand (``norm_statistics``, ``[B, N, 2]`` fp32) and read with each tile (``features``). Backward goes
the same way round: a kernel gives the gradient of the normalised, weighted pre-activation
(``features_backward``) and ``norm_backward`` finishes RMSNorm's backward across the heads
(``mhla.norm.rms_norm_backward_``, the torch path's).
"""
import torch
import triton
import triton.language as tl

from ..norm import inverse_rms, rms_norm_backward_

__all__ = ["features", "features_backward", "norm_backward", "norm_statistics"]


def _qk(qkv: torch.Tensor) -> torch.Tensor:
    """q and k of ``qkv`` ``[B, N, 3C]`` as ``[B, N, 2, C]`` in fp32 (at least)."""
    return qkv.unflatten(-1, (3, -1))[:, :, :2].to(torch.promote_types(qkv.dtype, torch.float32))


def norm_statistics(qkv: torch.Tensor, norm_eps: float | None) -> torch.Tensor:
    """``r`` of q and k, ``[B, N, 2]`` (contiguous, fp32 at least) from ``qkv`` ``[B, N, 3C]``.

    ``norm_eps`` None is the dtype's epsilon of the computation (fp32 for fp16/bf16 inputs), as the torch path.
    """
    return inverse_rms(_qk(qkv), norm_eps).squeeze(-1).contiguous()


@triton.jit
def features(x, rstd, weight, feature_eps, NORM: tl.constexpr):
    """``ReLU(x r w) + feature_eps`` (``NORM``) or ``ReLU(x) + feature_eps`` of a tile, in fp32.

    Shapes: x ``[BT, D]`` (any float dtype), rstd ``[BT]`` fp32, weight ``[D]`` fp32; unused without ``NORM``.
    """
    x = x.to(tl.float32)
    if NORM:
        x = x * rstd[:, None] * weight[None, :]
    return tl.maximum(x, 0.0) + feature_eps


@triton.jit
def features_backward(grad, x, rstd, weight, NORM: tl.constexpr):
    """The gradient of the pre-activation ``x r w`` (``NORM``) or ``x`` from that of ``features``' output.

    ReLU's gradient: ``grad`` where the pre-activation is positive, 0 elsewhere; shapes as ``features``.
    """
    x = x.to(tl.float32)
    if NORM:
        x = x * rstd[:, None] * weight[None, :]
    return tl.where(x > 0, grad, 0.0)


def norm_backward(grad_qk: torch.Tensor, qkv: torch.Tensor, rstd: torch.Tensor,
                  weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm's backward across the heads, written into ``grad_qk``; returns the weights' gradient ``[2, C]``.

    Args:
        grad_qk: ``[B, N, 2, C]`` fp32, the gradient of q's and k's ``x r w`` (``features_backward``); becomes
            that of x.
        qkv: ``[B, N, 3C]``, the input.
        rstd: ``[B, N, 2]``, ``norm_statistics(qkv)``.
        weight: ``[2, C]``, q's and k's RMSNorm weights.
    """
    normed = _qk(qkv) * rstd[..., None]
    return rms_norm_backward_(grad_qk, normed, rstd[..., None], weight.to(normed.dtype))
