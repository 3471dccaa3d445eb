"""RMSNorm that keeps only its input for backward (drop-in for timm's ``RmsNorm`` and ``nn.RMSNorm``).

``y = x r w`` with ``r = (mean(x^2) + eps)^(-1/2)`` over the last dim. Autograd through the
composite (``torch.nn.functional.rms_norm`` on the CPU) keeps the input, ``r`` and the normalised
input; this keeps the input alone and recomputes ``r`` in backward (one reduction), so a norm costs
what a LayerNorm costs (its input and two statistics), not one more copy of the activations. The
released linear baseline normalises every block with RMSNorm; ``deit_*_linear`` uses this.
"""
import torch
from torch import nn

__all__ = ["RMSNorm", "inverse_rms", "rms_norm", "rms_norm_backward_"]


def inverse_rms(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """``(mean(x^2) + eps)^(-1/2)`` over the last dim, ``[..., 1]``, in one pass (no ``x^2`` tensor).

    ``eps`` None is the dtype's epsilon, as ``torch.nn.functional.rms_norm``.
    """
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    return mean_square.add_(eps).rsqrt_()


def rms_norm_backward_(grad: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor,
                       weight: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient of RMSNorm w.r.t. ``x``, written into ``grad`` (its output's gradient); returns the weight's.

    Given ``normed`` x^ = x r and ``rstd`` r = (mean(x^2) + eps)^(-1/2) (``inverse_rms``):
    ``g_w = sum g x^`` over every dim but the weight's, and with ``G = r g w``:
    ``g_x = r (g w - x^ mean(g w x^)) = G - x^ mean(G x^)``.
    """
    grad_weight = None
    if weight is not None:
        grad_weight = torch.mul(grad, normed).sum(tuple(range(grad.ndim - weight.ndim)))  # no copy of a strided grad
        grad.mul_(weight)
    grad.mul_(rstd)  # G
    mean = torch.linalg.vecdot(grad, normed).unsqueeze_(-1).div_(normed.shape[-1])
    grad.addcmul_(normed, mean, value=-1)
    return grad_weight


class _RMSNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        out = x * inverse_rms(x, eps)
        return out if weight is None else out.mul_(weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.clone()
        rstd = inverse_rms(x, ctx.eps)
        grad_weight = rms_norm_backward_(grad, x * rstd, rstd, weight)
        return grad, grad_weight if ctx.needs_input_grad[1] else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` over the last dim, keeping only ``x`` (and ``weight``) for backward.

    ``x`` ``[..., C]``, ``weight`` ``[C]`` or None; ``eps`` None is the dtype's epsilon. Computed in
    the dtype ``x`` and ``weight`` promote to (fp32 for a bf16 input under autocast, as timm's).
    """
    if weight is not None and weight.dtype != x.dtype:
        dtype = torch.promote_types(x.dtype, weight.dtype)
        x, weight = x.to(dtype), weight.to(dtype)
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last ``channels`` dim with timm's ``RmsNorm`` signature and state dict (``weight``).

    Args:
        channels: C.
        eps: added to the mean square; None is the dtype's epsilon.
        affine: a learnable weight (ones at init).
    """

    def __init__(self, channels: int, eps: float | None = 1e-6, affine: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = (channels,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels, device=device, dtype=dtype)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, affine={self.weight is not None}"
