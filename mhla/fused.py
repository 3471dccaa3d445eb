"""Attention from the qkv projection's output in one autograd function that keeps only that output.

    qkv [B, N, 3C] -> q, k = ReLU(RMSNorm(q), RMSNorm(k)) + feature_eps, v    (per head, D = C / H)
                   -> o = linear attention / MHLA (block or parallel form)    [B, N, C]
                        + LePE(v) on the patch tokens (optional)

This is the attention modules' default path (``MultiHeadLinearAttention`` with the paper's
normalizer, ``LinearAttention``). Autograd through the same steps (``features`` and the ops of
``mhla.ops``) keeps, per layer, the normalised q and k, their feature maps, block-major copies of
q, k and v, the per-block summaries and the output. This function keeps the ``qkv`` tensor alone
and recomputes the rest in backward, the trade FlashAttention makes: the elementwise feature map,
and the summaries ``S_j = K_j^T V_j`` of the block form (one matmul of N D Dv) or the scores
``Q K^T`` of the parallel form (N^2 D). LePE's depthwise convolution reads v inside ``qkv`` and
writes its gradient into that of ``qkv``, with no zero-filled gradient of a slice. The math is
``mhla.ops``' (``blocks_*``, ``parallel_*``), so values and gradients are the ops'; the naive
reference is ``mhla.naive.naive_qkv_attention``.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .blocks import BlockLayout
from .norm import inverse_rms, rms_norm_backward_
from .ops import (
    _no_autocast,
    blocks_backward,
    blocks_forward,
    blocks_state,
    parallel_backward,
    parallel_forward,
    parallel_state,
)

__all__ = ["check_arguments", "feature_map", "feature_map_backward", "feature_map_state", "image", "lepe_backward_",
           "lepe_forward_", "qkv_attention"]


def feature_map(qk: torch.Tensor, weight: torch.Tensor | None, norm_eps: float | None,
                feature_eps: float) -> torch.Tensor:
    """``ReLU(RMSNorm(x) * weight) + feature_eps`` over the last dim C; ``weight`` None: ``ReLU(x) + feature_eps``.

    ``qk`` ``[..., C]`` (q and k side by side, e.g. ``[B, N, 2, C]`` with ``weight`` ``[2, C]``);
    ``norm_eps`` None is the dtype's epsilon, as ``torch.nn.functional.rms_norm``.
    """
    if weight is None:
        return qk.clamp_min(0).add_(feature_eps)
    return (qk * inverse_rms(qk, norm_eps)).mul_(weight).clamp_min_(0).add_(feature_eps)


def feature_map_state(qk: torch.Tensor, weight: torch.Tensor | None, norm_eps: float | None,
                      feature_eps: float) -> tuple[torch.Tensor, tuple]:
    """``feature_map`` (the same numbers) and what ``feature_map_backward`` needs: the ReLU's mask, x^ and r."""
    if weight is None:
        return qk.clamp_min(0).add_(feature_eps), (qk > 0,)
    rstd = inverse_rms(qk, norm_eps)
    normed = qk * rstd  # x^
    scaled = normed * weight
    active = scaled > 0
    return scaled.clamp_min_(0).add_(feature_eps), (active, normed, rstd)


def feature_map_backward(grad: torch.Tensor, state: tuple, weight: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient of ``feature_map`` w.r.t. ``qk``, written into ``grad`` (its output's); returns the weight's.

    ``state`` from ``feature_map_state``: the ReLU's gradient ``[x^ w > 0]``, then RMSNorm's
    (``mhla.norm.rms_norm_backward_``).
    """
    grad.mul_(state[0])
    return None if weight is None else rms_norm_backward_(grad, state[1], state[2], weight)


@dataclass(frozen=True)
class _Plan:
    """How the heads are laid out for the op: token order (linear, parallel) or the block layout."""

    num_heads: int
    layout: BlockLayout | None  # None: linear attention (one block of all tokens)
    parallel: bool
    grid_size: tuple[int, int] | None  # the patch tokens' grid (for LePE)

    def arrange(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, N, C]`` -> ``[B, H, N, D]`` (parallel), ``[B, H, 1, N, D]`` (linear) or ``[B, H, M + G, T, D]``.

        A contiguous copy, so that no matmul of the op copies its operands again.
        """
        x = x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # [B, H, N, D], a view
        if self.layout is not None and not self.parallel:
            return self.layout.to_blocks(x)
        x = x.contiguous()
        return x if self.parallel else x.unsqueeze(2)

    def tokens(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of ``arrange``: ``[B, N, C]``, written into ``out`` ``[B, N, C]`` if given."""
        if self.layout is not None and not self.parallel:
            x = x.permute(0, 2, 3, 1, 4)  # [B, M + G, T, H, D]
            if out is None:
                return self.layout.from_blocks(x, dim=1).flatten(2)
            return self.layout.from_blocks(x, dim=1, out=out.unflatten(-1, x.shape[-2:])).flatten(2)
        x = (x if self.parallel else x.squeeze(2)).transpose(1, 2)  # [B, N, H, D], a view
        return x.flatten(2) if out is None else out.unflatten(-1, x.shape[-2:]).copy_(x)

    def token_mixing(self, mixing: torch.Tensor) -> torch.Tensor:
        """W ``[M + G, M + G]`` -> ``W[b(t), b(s)]`` ``[N, N]``, the parallel form's mixing: ``E W E^T``.

        E ``[N, M + G]`` is the one-hot block of each token; two small matmuls, which are exact (each
        sum has one non-zero term) and cheaper than a gather of N x N entries.
        """
        one_hot = self.one_hot(mixing.dtype)
        return one_hot @ mixing @ one_hot.t()

    def token_mixing_backward(self, grad: torch.Tensor, mixing: torch.Tensor) -> torch.Tensor:
        """The gradient of W from that of ``token_mixing``: ``E^T G E``, the sum over each block pair."""
        one_hot = self.one_hot(mixing.dtype)
        return one_hot.t() @ grad @ one_hot

    def one_hot(self, dtype: torch.dtype) -> torch.Tensor:
        """E ``[N, M + G]``: ``E[t, j] = 1`` where token t is in block j."""
        layout = self.layout
        blocks = torch.arange(layout.num_blocks + layout.num_prefix_blocks, device=layout.block_ids.device)
        return (layout.block_ids[:, None] == blocks).to(dtype)  # not F.one_hot, which reads its input back from a GPU

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """0/1 ``[1, 1, M + G, T, 1]`` over the block slots, None where every slot holds a token."""
        if self.layout is None or self.parallel or self.layout.evenly_divided:
            return None
        return self.layout.mask[None, None, :, :, None].to(dtype)


def _prepare(qkv, q_weight, k_weight, mixing):
    """fp32 (at least) ``[B, N, 3, C]`` view of qkv, the joined ``[2, C]`` norm weight and the mixing."""
    dtype = torch.promote_types(qkv.dtype, torch.float32)
    x = qkv.to(dtype).unflatten(-1, (3, -1))
    weight = None if q_weight is None else torch.stack((q_weight, k_weight)).to(dtype)
    return x, weight, None if mixing is None else mixing.to(dtype)


def image(x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
    """The patch tokens of ``x`` ``[B, N, C]`` (the last gh * gw) as an image ``[B, C, gh, gw]`` (a view)."""
    return x[:, x.shape[1] - grid_size[0] * grid_size[1]:].unflatten(1, grid_size).permute(0, 3, 1, 2)


def lepe_forward_(out: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  grid_size: tuple[int, int]) -> None:
    """LePE, the depthwise convolution of v over the patch grid, added to ``out``'s patch tokens in place.

    ``out``, ``v`` ``[B, N, C]`` (any strides; the last gh * gw tokens are the grid), the convolution in v's dtype.
    """
    conv = F.conv2d(image(v, grid_size), weight.to(v.dtype), None if bias is None else bias.to(v.dtype),
                    padding=weight.shape[-1] // 2, groups=weight.shape[0])
    image(out, grid_size).add_(conv)


def lepe_backward_(grad_v: torch.Tensor, grad_out: torch.Tensor, v: torch.Tensor, weight: torch.Tensor,
                   has_bias: bool, grid_size: tuple[int, int], needs: tuple[bool, bool]):
    """LePE's backward: v's gradient added into ``grad_v`` ``[B, N, C]`` in place; returns the gradients of the
    weight and the bias (None where ``needs`` says False), in v's dtype."""
    grad, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        image(grad_out, grid_size), image(v, grid_size), weight.to(v.dtype), [weight.shape[0]] if has_bias else None,
        [1, 1], [weight.shape[-1] // 2] * 2, [1, 1], False, [0, 0], weight.shape[0],
        [True, needs[0], has_bias and needs[1]])
    image(grad_v, grid_size).add_(grad)
    return grad_weight, grad_bias


class _QKVAttentionFunction(torch.autograd.Function):
    """The attention from ``qkv``, keeping ``qkv`` (and the small parameters) alone for backward.

    The backward holds as few temporaries at once as it can: q, k, v arranged for the op, at most
    three N x N tensors (parallel form) or the gradients, and it frees each as soon as it is used.
    LePE's convolution reads v in ``qkv`` and writes its gradient into that of ``qkv`` directly.
    """

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, mixing, lepe_weight, lepe_bias, plan, norm_eps, feature_eps, eps):
        ctx.save_for_backward(qkv, q_weight, k_weight, mixing, lepe_weight)
        ctx.plan, ctx.norm_eps, ctx.feature_eps, ctx.eps = plan, norm_eps, feature_eps, eps
        ctx.has_bias = lepe_bias is not None
        x, weight, mixing = _prepare(qkv, q_weight, k_weight, mixing)
        qk = feature_map(x[:, :, :2], weight, norm_eps, feature_eps)  # [B, N, 2, C]
        q, k, v = plan.arrange(qk[:, :, 0]), plan.arrange(qk[:, :, 1]), plan.arrange(x[:, :, 2])
        del qk
        if plan.parallel:
            out, _ = parallel_forward(q, k, v, plan.token_mixing(mixing), eps, keep_scores=False)
        else:
            out, _ = blocks_forward(q, k, v, plan.mask(x.dtype), mixing, eps)
        del q, k, v
        out = plan.tokens(out)  # [B, N, C]
        if lepe_weight is not None:
            lepe_forward_(out, x[:, :, 2], lepe_weight, lepe_bias, plan.grid_size)
        return out.to(qkv.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qkv, q_weight, k_weight, mixing, lepe_weight = ctx.saved_tensors
        plan, eps, needs = ctx.plan, ctx.eps, ctx.needs_input_grad
        needs_op = (True, True, True, mixing is not None and needs[3])
        with _no_autocast(qkv.device.type):
            x, weight, mixing = _prepare(qkv, q_weight, k_weight, mixing)
            grad_out = grad_out.to(x.dtype)
            token_mixing = plan.token_mixing(mixing) if plan.parallel else None
            mask = plan.mask(x.dtype)
            grad_x = torch.empty_like(x)  # [B, N, 3, C]
            grad_weight = grad_mixing = None
            for part in _chunks(plan, x.shape[0], x.shape[1], x.shape[-1], x.device.type == "cpu"):
                qk, state = feature_map_state(x[part, :, :2], weight, ctx.norm_eps, ctx.feature_eps)
                q, k, v = plan.arrange(qk[:, :, 0]), plan.arrange(qk[:, :, 1]), plan.arrange(x[part, :, 2])
                del qk
                if plan.parallel:
                    grads = list(parallel_backward(plan.arrange(grad_out[part]), q, k, v, token_mixing,
                                                   *parallel_state(q, k, token_mixing, eps), needs_op, overwrite=True))
                else:
                    grads = list(blocks_backward(_masked(plan.arrange(grad_out[part]), mask), q, v, mask,
                                                 mixing, blocks_state(q, k, v, mask, mixing, eps), needs_op))
                del q, k, v
                for i in range(3):
                    plan.tokens(grads[i], out=grad_x[part, :, i])
                    grads[i] = None
                grad_weight = _add(grad_weight, feature_map_backward(grad_x[part, :, :2], state, weight))
                del state
                grad_mixing = _add(grad_mixing, grads[3])
            if plan.parallel and grad_mixing is not None:
                grad_mixing = plan.token_mixing_backward(grad_mixing, mixing)
            grad_lepe_weight = grad_lepe_bias = None
            if lepe_weight is not None:
                grad_lepe_weight, grad_lepe_bias = lepe_backward_(grad_x[:, :, 2], grad_out, x[:, :, 2], lepe_weight,
                                                                  ctx.has_bias, plan.grid_size, needs[4:6])
        grad_q_weight = grad_k_weight = None
        if grad_weight is not None:
            grad_q_weight, grad_k_weight = grad_weight.to(q_weight.dtype).unbind(0)
        grad_mixing = None if grad_mixing is None else grad_mixing.to(mixing.dtype)
        if grad_lepe_weight is not None:
            grad_lepe_weight = grad_lepe_weight.to(lepe_weight.dtype)
        if grad_lepe_bias is not None:
            grad_lepe_bias = grad_lepe_bias.to(lepe_weight.dtype)
        return (grad_x.flatten(2).to(qkv.dtype), grad_q_weight, grad_k_weight, grad_mixing, grad_lepe_weight,
                grad_lepe_bias, None, None, None, None)


# The parallel form's backward takes at most this many elements per N x N temporary (1 MiB in fp32),
# so that they stay in cache: at 224 px on a 2-core CPU, chunks of 2 images (this bound) took 6%
# less CPU time than chunks of 8 at batch 8, and 5% / 12% less than 8 / 32 at batch 32; chunks of
# 1 image took 23% more (per-call overhead).
_CACHE_ELEMENTS = 2 ** 18


def _chunks(plan: _Plan, batch: int, tokens: int, dim: int, cpu: bool) -> list[slice]:
    """Slices of the batch that the backward takes one at a time, so that its temporaries stay small.

    The parallel form: a chunk's N x N temporaries (three at most) no larger than one ``[B, N, C]``
    tensor, so that a short sequence needs no more memory than a long one, and on a CPU than
    ``_CACHE_ELEMENTS`` (a GPU, whose cache is not the point, runs large chunks better); the block
    form: a quarter of the batch, so that the recomputed q, k, v and the op's gradients are a
    quarter of their size.
    """
    if plan.parallel:
        per_sample = plan.num_heads * tokens
        size = max(1, batch * dim // per_sample)
        if cpu:
            size = max(1, min(size, _CACHE_ELEMENTS // (per_sample * tokens)))
    else:
        size = -(-batch // 4)
    return [slice(start, start + size) for start in range(0, batch, size)]


def _masked(grad: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The output's gradient in block layout with the padding slots' zeroed (they are not outputs)."""
    return grad if mask is None else grad.mul_(mask)


def _add(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    return part if total is None else total.add_(part)


def check_arguments(
        qkv: torch.Tensor,
        num_heads: int,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        mixing: torch.Tensor | None,
        layout: BlockLayout | None,
        parallel: bool = False,
        lepe_weight: torch.Tensor | None = None,
        lepe_bias: torch.Tensor | None = None,
        grid_size: tuple[int, int] | None = None,
) -> tuple[int, int] | None:
    """The one-line ``ValueError`` for arguments of ``qkv_attention`` (and of the kernels) that do not fit
    together; returns the patch grid (``layout``'s, else ``grid_size``)."""
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(f"qkv must be [B, N, 3C] with C divisible by num_heads={num_heads}, got {tuple(qkv.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together: give both or neither")
    num_tokens, dim = qkv.shape[1], qkv.shape[-1] // 3
    if (mixing is None) != (layout is None):
        raise ValueError("MHLA needs both mixing and layout (plain linear attention neither)")
    if parallel and layout is None:
        raise ValueError("parallel=True is a form of MHLA: give mixing and layout")
    if layout is not None:
        if layout.num_tokens != num_tokens:
            raise ValueError(f"layout is for {layout.num_tokens} tokens, qkv has N={num_tokens}")
        blocks = layout.num_blocks + layout.num_prefix_blocks
        if mixing.shape != (blocks, blocks):
            raise ValueError(f"mixing must be [M + G, M + G] = [{blocks}, {blocks}] for this layout, got "
                             f"{tuple(mixing.shape)}")
        grid_size = layout.grid_size
    if lepe_weight is not None:
        kernel = lepe_weight.shape[-1]
        if lepe_weight.shape != (dim, 1, kernel, kernel) or kernel % 2 == 0:
            raise ValueError(f"lepe_weight must be [C, 1, k, k] with C={dim} and k odd, got {tuple(lepe_weight.shape)}")
        if lepe_bias is not None and lepe_bias.shape != (dim,):
            raise ValueError(f"lepe_bias must be [C] = [{dim}], got {tuple(lepe_bias.shape)}")
        if grid_size is None or not 0 < grid_size[0] * grid_size[1] <= num_tokens:
            raise ValueError(f"LePE needs the patch grid: grid_size={grid_size} for N={num_tokens} tokens")
    return None if grid_size is None else tuple(grid_size)


def qkv_attention(
        qkv: torch.Tensor,
        num_heads: int,
        *,
        q_weight: torch.Tensor | None = None,
        k_weight: torch.Tensor | None = None,
        norm_eps: float | None = 1e-6,
        feature_eps: float = 1e-6,
        eps: float = 1e-6,
        mixing: torch.Tensor | None = None,
        layout: BlockLayout | None = None,
        parallel: bool = False,
        lepe_weight: torch.Tensor | None = None,
        lepe_bias: torch.Tensor | None = None,
        grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Linear attention or MHLA (paper normalizer) from the qkv projection's output, keeping only ``qkv`` for backward.

    Args:
        qkv: ``[B, N, 3C]``, q, k and v side by side (``nn.Linear(C, 3C)``'s output), N tokens in
            the order of ``layout`` (prefix tokens first, then the patch grid in raster order).
        num_heads: H; the head dim is C / H.
        q_weight, k_weight: ``[C]`` RMSNorm weights of q and k; None (both) for no q/k norm.
        norm_eps: the RMSNorm epsilon; None is the dtype's epsilon.
        feature_eps: the feature map's offset, ``phi(x) = ReLU(x) + feature_eps``.
        eps: added to the denominator.
        mixing: None for plain linear attention (one summary per head); W ``[M + G, M + G]`` over the
            layout's blocks for MHLA (``MultiHeadLinearAttention.full_mixing``).
        layout: MHLA's block layout (``mhla.blocks.block_layout``).
        parallel: the N x N form (as ``mhla.ops.mhla_attention_parallel``) instead of the block form.
        lepe_weight, lepe_bias: LePE, a depthwise convolution of v over the patch grid added to the
            output (``mhla.lepe.LePE``'s ``conv``): weight ``[C, 1, k, k]`` (k odd), bias ``[C]`` or None.
        grid_size: the patch tokens' ``(gh, gw)`` grid, the last gh * gw of the N tokens; for LePE in
            plain linear attention (MHLA takes it from ``layout``).

    Returns:
        ``[B, N, C]`` in the dtype of ``qkv``; under autocast everything inside runs in fp32.
    """
    grid_size = check_arguments(qkv, num_heads, q_weight, k_weight, mixing, layout, parallel, lepe_weight, lepe_bias,
                                grid_size)
    plan = _Plan(num_heads, layout, parallel, grid_size)
    with _no_autocast(qkv.device.type):
        return _QKVAttentionFunction.apply(qkv, q_weight, k_weight, mixing, lepe_weight, lepe_bias, plan, norm_eps,
                                           feature_eps, eps)
