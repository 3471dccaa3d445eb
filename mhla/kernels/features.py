"""The feature map on load, shared by the kernels: ``phi = ReLU(RMSNorm(x) w) + feature_eps`` for q and k.

RMSNorm normalises each token over all C channels, across the heads, while a kernel's program sees one
head's D columns: the per-token statistic ``r = (mean(x^2) + eps)^(-1/2)`` of q and k is computed once
beforehand (``norm_statistics``, one launch, ``[B, N, 2]`` fp32) and read with each tile (``features``).
Backward goes the same way round: a kernel gives the gradient of the normalised, weighted pre-activation
(``features_backward``) and ``norm_backward`` finishes RMSNorm's backward across the heads (one launch, the
math of the torch path's ``mhla.norm.rms_norm_backward_``), deterministic: the weights' gradient is summed
per program, then over the programs in a fixed order.
"""
import torch
import triton
import triton.language as tl

__all__ = ["NORM_ROWS", "features", "features_backward", "norm_backward", "norm_statistics"]


@triton.jit
def _rstd_kernel(qkv, rstd, eps, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program t (a token of ``[B * N]``): ``r = (mean(x^2) + eps)^(-1/2)`` of its q and k into rstd ``[B * N, 2]``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    for part in tl.static_range(2):
        x = tl.load(qkv + t * 3 * C + part * C + cols, mask=cols < C, other=0.0).to(tl.float32)
        tl.store(rstd + t * 2 + part, 1.0 / tl.sqrt(tl.sum(x * x, 0) / C + eps))


def norm_statistics(qkv: torch.Tensor, norm_eps: float | None) -> torch.Tensor:
    """``r`` of q and k, ``[B, N, 2]`` fp32, from ``qkv`` ``[B, N, 3C]`` (contiguous): one launch.

    ``norm_eps`` None is fp32's epsilon, the dtype the torch path normalises in for fp16, bf16 and fp32 inputs.
    """
    batch, tokens, dim = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    rstd = torch.empty(batch, tokens, 2, dtype=torch.float32, device=qkv.device)
    eps = torch.finfo(torch.float32).eps if norm_eps is None else norm_eps
    _rstd_kernel[(batch * tokens,)](qkv, rstd, eps, C=dim, BLOCK_C=triton.next_power_of_2(dim))
    return rstd


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


@triton.jit
def _norm_backward_kernel(qkv, rstd, weight, grad, partial, num_tokens, C: tl.constexpr, BLOCK_C: tl.constexpr,
                          ROWS: tl.constexpr):
    """Program p: RMSNorm's backward for tokens ``p ROWS ..`` of ``[B * N]``, q and k, in place in grad
    ``[B * N, 3, C]``; the weights' gradient over these tokens into partial ``[programs, 2, C]``.

    With x^ = x r and G = r g w: ``g_x = G - x^ mean(G x^)`` and ``g_w = sum g x^`` (``mhla.norm.rms_norm_backward_``).
    """
    p = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    inside = cols < C
    for part in tl.static_range(2):
        w = tl.load(weight + part * C + cols, mask=inside, other=0.0)
        grad_w = tl.zeros([BLOCK_C], tl.float32)
        for i in range(ROWS):
            t = p.to(tl.int64) * ROWS + i
            valid = inside & (t < num_tokens)
            x = tl.load(qkv + t * 3 * C + part * C + cols, mask=valid, other=0.0).to(tl.float32)
            r = tl.load(rstd + t * 2 + part, mask=t < num_tokens, other=0.0)
            g = tl.load(grad + t * 3 * C + part * C + cols, mask=valid, other=0.0)
            normed = x * r
            grad_w += g * normed
            big_g = r * g * w
            grad_x = big_g - normed * (tl.sum(big_g * normed, 0) / C)
            tl.store(grad + t * 3 * C + part * C + cols, grad_x, mask=valid)
        tl.store(partial + (p * 2 + part) * C + cols, grad_w, mask=inside)


NORM_ROWS = 16  # tokens per program of the norm's backward: the weights' partial sums are [B N / 16, 2, C]


def norm_backward(grad: torch.Tensor, qkv: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm's backward across the heads, written into ``grad``; returns the weights' gradient ``[2, C]`` (fp32).

    Args:
        grad: ``[B, N, 3, C]`` fp32 (contiguous): in its q and k slots, the gradient of q's and k's ``x r w``
            (``features_backward``), which becomes that of x; the v slot is left as it is.
        qkv: ``[B, N, 3C]``, the input (contiguous).
        rstd: ``[B, N, 2]``, ``norm_statistics(qkv)``.
        weight: ``[2, C]`` fp32 (contiguous), q's and k's RMSNorm weights.
    """
    tokens, dim = qkv.shape[0] * qkv.shape[1], qkv.shape[2] // 3
    programs = triton.cdiv(tokens, NORM_ROWS)
    partial = torch.empty(programs, 2, dim, dtype=torch.float32, device=qkv.device)
    _norm_backward_kernel[(programs,)](qkv, rstd, weight, grad, partial, tokens, C=dim,
                                       BLOCK_C=triton.next_power_of_2(dim), ROWS=NORM_ROWS)
    return partial.sum(0)  # in a fixed order: deterministic
