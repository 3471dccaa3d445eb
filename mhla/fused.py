"""Attention from the qkv projection's output in one autograd function that keeps only that output.

    qkv [B, N, 3C] -> q, k = ReLU(RMSNorm(q), RMSNorm(k)) + feature_eps, v    (per head, D = C / H)
                   -> o = linear attention / MHLA (block or parallel form)    [B, N, C]

This is the attention modules' default path (``MultiHeadLinearAttention`` with the paper's
normalizer, ``LinearAttention``). Autograd through the same steps (``features`` and the ops of
``mhla.ops``) keeps, per layer, the normalised q and k, their feature maps, block-major copies of
q, k and v, the per-block summaries and the output. This function keeps the ``qkv`` tensor alone
(which LePE's convolution keeps anyway, as a view of v) and recomputes the rest in backward, the
trade FlashAttention makes: the elementwise feature map, and the summaries ``S_j = K_j^T V_j`` of
the block form (one matmul of N D Dv) or the scores ``Q K^T`` of the parallel form (N^2 D). The
math is ``mhla.ops``' (``blocks_*``, ``parallel_*``), so values and gradients are the ops'; the
naive reference is ``mhla.naive.naive_qkv_attention``.
"""
from dataclasses import dataclass

import torch

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

__all__ = ["feature_map", "feature_map_backward", "qkv_attention"]


def feature_map(qk: torch.Tensor, weight: torch.Tensor | None, norm_eps: float | None,
                feature_eps: float) -> torch.Tensor:
    """``ReLU(RMSNorm(x) * weight) + feature_eps`` over the last dim C; ``weight`` None: ``ReLU(x) + feature_eps``.

    ``qk`` ``[..., C]`` (q and k side by side, e.g. ``[B, N, 2, C]`` with ``weight`` ``[2, C]``);
    ``norm_eps`` None is the dtype's epsilon, as ``torch.nn.functional.rms_norm``. Computed as
    ``max(x^ w + feature_eps, feature_eps)``, which is the same number, in three passes.
    """
    if weight is None:
        return qk.clamp_min(0).add_(feature_eps)
    normed = qk * inverse_rms(qk, norm_eps)
    return torch.addcmul(normed.new_tensor(feature_eps), normed, weight).clamp_min_(feature_eps)


def feature_map_backward(grad: torch.Tensor, qk: torch.Tensor, weight: torch.Tensor | None,
                         norm_eps: float | None) -> torch.Tensor | None:
    """The gradient of ``feature_map`` w.r.t. ``qk``, written into ``grad`` (its output's); returns the weight's.

    ReLU's gradient ``[x^ w > 0]`` (``[x w > 0]``: r > 0), then RMSNorm's (``mhla.norm.rms_norm_backward_``).
    """
    if weight is None:
        grad.mul_(qk > 0)
        return None
    grad.mul_(torch.mul(qk, weight) > 0)
    return rms_norm_backward_(grad, qk, weight, norm_eps)


@dataclass(frozen=True)
class _Plan:
    """How the heads are laid out for the op: token order (linear, parallel) or the block layout."""

    num_heads: int
    layout: BlockLayout | None  # None: linear attention (one block of all tokens)
    parallel: bool

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
        """W ``[M + G, M + G]`` -> ``W[b(t), b(s)]`` ``[N, N]``, the parallel form's mixing."""
        ids = self.layout.block_ids
        return mixing[ids[:, None], ids[None, :]]

    def token_mixing_backward(self, grad: torch.Tensor, mixing: torch.Tensor) -> torch.Tensor:
        """The gradient of W from that of ``token_mixing``: the sum over each block pair."""
        ids = self.layout.block_ids
        return torch.zeros_like(mixing).index_put_((ids[:, None], ids[None, :]), grad, accumulate=True)

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


def _features(plan: _Plan, x: torch.Tensor, weight: torch.Tensor | None, norm_eps: float | None,
              feature_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (feature-mapped) and v of ``x`` ``[B, N, 3, C]``, each arranged for the op (``_Plan.arrange``)."""
    qk = feature_map(x[:, :, :2], weight, norm_eps, feature_eps)  # [B, N, 2, C]
    return plan.arrange(qk[:, :, 0]), plan.arrange(qk[:, :, 1]), plan.arrange(x[:, :, 2])


class _QKVAttentionFunction(torch.autograd.Function):
    """The attention from ``qkv``, keeping ``qkv`` (and the small parameters) alone for backward.

    The backward holds as few temporaries at once as it can: q, k, v arranged for the op, at most
    three N x N tensors (parallel form) or the gradients, and it frees each as soon as it is used.
    """

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, mixing, plan, norm_eps, feature_eps, eps):
        ctx.save_for_backward(qkv, q_weight, k_weight, mixing)
        ctx.plan, ctx.norm_eps, ctx.feature_eps, ctx.eps = plan, norm_eps, feature_eps, eps
        x, weight, mixing = _prepare(qkv, q_weight, k_weight, mixing)
        q, k, v = _features(plan, x, weight, norm_eps, feature_eps)
        if plan.parallel:
            out, _ = parallel_forward(q, k, v, plan.token_mixing(mixing), eps, keep_scores=False)
        else:
            out, _ = blocks_forward(q, k, v, plan.mask(x.dtype), mixing, eps)
        del q, k, v
        return plan.tokens(out).to(qkv.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qkv, q_weight, k_weight, mixing = ctx.saved_tensors
        plan, eps, needs = ctx.plan, ctx.eps, ctx.needs_input_grad
        needs_op = (True, True, True, mixing is not None and needs[3])
        with _no_autocast(qkv.device.type):
            x, weight, mixing = _prepare(qkv, q_weight, k_weight, mixing)
            token_mixing = plan.token_mixing(mixing) if plan.parallel else None
            mask = plan.mask(x.dtype)
            grad_x = torch.empty_like(x)  # [B, N, 3, C]
            grad_weight = grad_mixing = None
            for part in _chunks(plan, x.shape[0], x.shape[1], x.shape[-1]):
                q, k, v = _features(plan, x[part], weight, ctx.norm_eps, ctx.feature_eps)
                if plan.parallel:
                    grads = list(parallel_backward(plan.arrange(grad_out[part].to(x.dtype)), q, k, v, token_mixing,
                                                   *parallel_state(q, k, token_mixing, eps), needs_op, overwrite=True))
                else:
                    grads = list(blocks_backward(_masked(plan.arrange(grad_out[part].to(x.dtype)), mask), q, v, mask,
                                                 mixing, blocks_state(q, k, v, mask, mixing, eps), needs_op))
                del q, k, v
                for i in range(3):
                    plan.tokens(grads[i], out=grad_x[part, :, i])
                    grads[i] = None
                grad_weight = _add(grad_weight, feature_map_backward(grad_x[part, :, :2], x[part, :, :2], weight,
                                                                     ctx.norm_eps))
                grad_mixing = _add(grad_mixing, grads[3])
            if plan.parallel and grad_mixing is not None:
                grad_mixing = plan.token_mixing_backward(grad_mixing, mixing)
        grad_q_weight = grad_k_weight = None
        if grad_weight is not None:
            grad_q_weight, grad_k_weight = grad_weight.to(q_weight.dtype).unbind(0)
        grad_mixing = None if grad_mixing is None else grad_mixing.to(mixing.dtype)
        return grad_x.flatten(2).to(qkv.dtype), grad_q_weight, grad_k_weight, grad_mixing, None, None, None, None


def _chunks(plan: _Plan, batch: int, tokens: int, dim: int) -> list[slice]:
    """Slices of the batch that the backward takes one at a time, so that its temporaries stay small.

    The parallel form: a chunk's N x N temporaries (three at most) no larger than one ``[B, N, C]``
    tensor, so that a short sequence needs no more memory than a long one; the block form: a
    quarter of the batch, so that the recomputed q, k, v and the op's gradients are a quarter of
    their size.
    """
    size = max(1, batch * dim // (plan.num_heads * tokens)) if plan.parallel else -(-batch // 4)
    return [slice(start, start + size) for start in range(0, batch, size)]


def _masked(grad: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The output's gradient in block layout with the padding slots' zeroed (they are not outputs)."""
    return grad if mask is None else grad.mul_(mask)


def _add(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    return part if total is None else total.add_(part)


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

    Returns:
        ``[B, N, C]`` in the dtype of ``qkv``; under autocast everything inside runs in fp32.
    """
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(f"qkv must be [B, N, 3C] with C divisible by num_heads={num_heads}, got {tuple(qkv.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together: give both or neither")
    num_tokens = qkv.shape[1]
    if (mixing is None) != (layout is None):
        raise ValueError("MHLA needs both mixing and layout (plain linear attention neither)")
    if parallel and layout is None:
        raise ValueError("parallel=True is a form of MHLA: give mixing and layout")
    if layout is not None:
        if layout.num_tokens != num_tokens:
            raise ValueError(f"layout is for {layout.num_tokens} tokens, qkv has N={num_tokens}")
        blocks = layout.num_blocks + layout.num_prefix_blocks
        if mixing is None or mixing.shape != (blocks, blocks):
            raise ValueError(f"mixing must be [M + G, M + G] = [{blocks}, {blocks}] for this layout, got "
                             f"{None if mixing is None else tuple(mixing.shape)}")
    plan = _Plan(num_heads, layout, parallel)
    with _no_autocast(qkv.device.type):
        return _QKVAttentionFunction.apply(qkv, q_weight, k_weight, mixing, plan, norm_eps, feature_eps, eps)
