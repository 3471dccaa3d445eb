"""MHLA and linear attention as functional ops (batched matmuls, O(N) time and memory).

Both ops take queries and keys that are already feature-mapped (non-negative, e.g. ReLU + eps).
Nothing of size N x N is ever built: the keys and values are first reduced to per-block summaries
``S_j = K_j^T V_j`` (``D x Dv``) and key sums ``z_j``, the summaries are mixed by W, and each query
reads the mixed summary of its own block; batched matmuls only, forward and (hand-written)
backward. Under autocast (fp16/bf16) everything inside the op runs in fp32, so that sums over many
thousands of tokens neither overflow nor lose precision; the output comes back in the input
dtype. The naive N x N references are in ``mhla.naive``.

``mhla_attention_parallel`` computes the same MHLA output the other way round, through the
``N x N`` matrix (the *parallel form*, as in RetNet or fla): two large matmuls of ``2 N^2 D``
multiply-adds instead of many small ones over ``M T D Dv + M^2 D Dv``. For short sequences
(N around 4 D or less) the large matmuls run several times more efficiently than the small ones
and need no block-major copy of the tokens, so the parallel form is faster although its cost
grows as N^2; ``MultiHeadLinearAttention`` picks the form per token grid.
"""
import contextlib

import torch

__all__ = ["NORMALIZERS", "linear_attention", "mhla_attention", "mhla_attention_parallel"]

NORMALIZERS = ("paper", "official")


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Leave autocast for the op where it is on; nothing to leave elsewhere (``meta``, devices without autocast)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast to fp32 at least (fp64 stays fp64)."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return tuple(t.to(dtype) for t in tensors)


def blocks_state(q, k, v, mask, mixing, eps):
    """What ``blocks_forward`` computes before its output, and its backward needs.

    Shapes: q, k ``[..., M, T, D]``, v ``[..., M, T, Dv]``, ``mask`` None or a 0/1 multiplier that
    broadcasts to ``[..., M, T, 1]``, ``mixing`` ``[M, M]`` or None (no mixing: plain linear attention
    when M = 1). Returns (masked k, S ``[..., M, D, Dv]``, z ``[..., M, D, 1]``, mixed S, mixed z,
    denominator ``[..., M, T, 1]``).
    """
    if mask is not None:
        k = k * mask  # masked keys leave every sum
    kv = k.transpose(-1, -2) @ v  # [..., M, D, Dv]: S_j
    z = k.sum(-2, keepdim=True).transpose(-1, -2)  # [..., M, D, 1]: z_j
    kv_mixed, z_mixed = (kv, z) if mixing is None else (_mix(mixing, kv), _mix(mixing, z))
    den = q @ z_mixed + eps  # [..., M, T, 1]
    return k, kv, z, kv_mixed, z_mixed, den


def blocks_forward(q, k, v, mask, mixing, eps):
    """``o = q^T (sum_j W_ij S_j) / (q^T (sum_j W_ij z_j) + eps)`` per block: ``[..., M, T, Dv]``, and its state.

    Shapes as ``blocks_state``. Numerator and denominator are kept apart so that every large matmul
    has the aligned shapes ``D x Dv`` (a ones-column appended to V makes them 65 wide, which is slower).
    """
    state = blocks_state(q, k, v, mask, mixing, eps)
    return (q @ state[3]).div_(state[5]), state


def blocks_backward(grad_out, q, v, mask, mixing, state, needs_grad):
    """Gradients ``(q, k, v, mixing)`` of ``blocks_forward`` (None where ``needs_grad`` says False).

    A handful of batched matmuls where autograd would add copies and zero-filled buffers; the
    output itself is not needed: ``grad_out . o = q . (grad_num S~^T)`` comes from the matmul that
    ``grad_q`` needs anyway. No temporary of the tokens' size beyond the gradients themselves.
    """
    k, kv, z, kv_mixed, z_mixed, den = state
    grad_num = grad_out / den  # [..., M, T, Dv]
    del grad_out
    grad_q = grad_num @ kv_mixed.transpose(-1, -2)  # [..., M, T, D], the numerator's part
    grad_den = torch.linalg.vecdot(q, grad_q).unsqueeze_(-1).div_(den).neg_()  # [..., M, T, 1]: -(grad_num . o)
    grad_q = grad_q.addcmul_(grad_den, z_mixed.transpose(-1, -2)) if needs_grad[0] else None
    grad_kv = q.transpose(-1, -2) @ grad_num  # [..., M, D, Dv], w.r.t. kv_mixed
    del grad_num
    grad_z = q.transpose(-1, -2) @ grad_den  # [..., M, D, 1], w.r.t. z_mixed
    grad_mixing = None
    if mixing is not None:
        if needs_grad[3]:
            grad_mixing = _mix_grad(grad_kv, kv) + _mix_grad(grad_z, z)
        grad_kv, grad_z = _mix(mixing.t(), grad_kv), _mix(mixing.t(), grad_z)  # w.r.t. kv, z
    grad_k = None
    if needs_grad[1]:
        grad_k = (v @ grad_kv.transpose(-1, -2)).add_(grad_z.transpose(-1, -2))  # [..., M, T, D]
        if mask is not None:
            grad_k = grad_k.mul_(mask)
    grad_v = k @ grad_kv if needs_grad[2] else None  # [..., M, T, Dv]; masked k rows are 0
    return grad_q, grad_k, grad_v, grad_mixing


def parallel_state(q, k, token_mixing, eps, keep_scores=True):
    """Scores ``Q K^T``, ``A = scores * W_tok`` and the denominator ``A 1 + eps`` ``[..., N, 1]``.

    Shapes: q, k ``[..., N, D]``, ``token_mixing`` ``[N, N]`` (``W[b(t), b(s)]``). ``keep_scores=False``
    lets A overwrite the scores (when no backward follows).
    """
    scores = q @ k.transpose(-1, -2)  # [..., N, N]
    attn = scores * token_mixing if keep_scores else scores.mul_(token_mixing)
    return scores, attn, attn.sum(-1, keepdim=True).add_(eps)


def parallel_forward(q, k, v, token_mixing, eps, keep_scores=True):
    """``o = (A V) / (A 1 + eps)`` with ``A = (Q K^T) * W_tok``: ``[..., N, Dv]``, and (scores, denominator).

    Shapes as ``parallel_state``, v ``[..., N, Dv]``.
    """
    scores, attn, den = parallel_state(q, k, token_mixing, eps, keep_scores)
    return (attn @ v).div_(den), (scores, den)


def parallel_backward(grad_out, q, k, v, token_mixing, scores, attn, den, needs_grad, overwrite=False):
    """Gradients ``(q, k, v, token_mixing)`` of ``parallel_forward`` (None where ``needs_grad`` says False).

    A (``attn``) is rebuilt from the scores if None (one elementwise product); ``grad_out . o`` comes
    from ``grad_num V^T``, which the gradient of A needs anyway, so the output is not needed. At
    most three N x N tensors live at once; ``overwrite=True`` lets it reuse the scores' memory. Pass
    the tensors it may free (``grad_out``, ``scores``, ``attn``) without holding them, and each is
    freed as soon as it is used.
    """
    attn = scores * token_mixing if attn is None else attn  # [..., N, N]
    grad_num = grad_out / den  # [..., N, Dv]
    del grad_out
    grad_attn = grad_num @ v.transpose(-1, -2)  # [..., N, N], the numerator's part
    grad_den = torch.linalg.vecdot(attn, grad_attn).unsqueeze_(-1).div_(den).neg_()  # [..., N, 1]: -(grad_num . o)
    grad_v = attn.transpose(-1, -2) @ grad_num if needs_grad[2] else None  # [..., N, Dv]
    del attn, grad_num
    grad_attn = grad_attn.add_(grad_den)
    grad_mixing = None
    if needs_grad[3]:
        product = scores.mul_(grad_attn) if overwrite else scores * grad_attn
        grad_mixing = product.flatten(0, -3).sum(0)  # [N, N]
        del product
    del scores
    grad_scores = grad_attn.mul_(token_mixing)
    grad_q = grad_scores @ k if needs_grad[0] else None  # [..., N, D]
    grad_k = grad_scores.transpose(-1, -2) @ q if needs_grad[1] else None  # [..., N, D]
    return grad_q, grad_k, grad_v, grad_mixing


class _LinearAttentionFunction(torch.autograd.Function):
    """``blocks_forward`` with its hand-written backward; keeps q, k, v and the per-block summaries."""

    @staticmethod
    def forward(ctx, q, k, v, mask, mixing, eps):
        out, state = blocks_forward(q, k, v, mask, mixing, eps)
        ctx.save_for_backward(q, v, mask, mixing, *state)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, v, mask, mixing, *state = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_q, grad_k, grad_v, grad_mixing = blocks_backward(
            grad_out, q, v, mask, mixing, state, (needs[0], needs[1], needs[2], needs[4]))
        return grad_q, grad_k, grad_v, None, grad_mixing, None


class _ParallelFunction(torch.autograd.Function):
    """``parallel_forward`` with its hand-written backward; keeps q, k, v and the scores (one N x N per head)."""

    @staticmethod
    def forward(ctx, q, k, v, token_mixing, eps):
        out, state = parallel_forward(q, k, v, token_mixing, eps, keep_scores=any(ctx.needs_input_grad))
        ctx.save_for_backward(q, k, v, token_mixing, *state)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, token_mixing, scores, den = ctx.saved_tensors
        return *parallel_backward(grad_out, q, k, v, token_mixing, scores, None, den, ctx.needs_input_grad[:4]), None


def _check_token_order(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.ndim != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"expected q, k [B, H, N, D] and v [B, H, N, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}")


def _mix(mixing: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum_j W_ij x_j`` for x ``[..., M, D, E]`` (one batched matmul, no copy of x)."""
    flat = x.flatten(-2).flatten(0, -3)  # [G, M, D * E]
    return torch.bmm(mixing.expand(flat.shape[0], -1, -1), flat).view_as(x)


def _mix_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gradient of ``_mix(W, x)`` w.r.t. W, given the gradient of its output: ``[M, M]``."""
    flat_grad, flat_x = grad.flatten(-2).flatten(0, -3), x.flatten(-2).flatten(0, -3)  # [G, M, D * E]
    return (flat_grad @ flat_x.transpose(-1, -2)).sum(0)


def mhla_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mixing: torch.Tensor,
        *,
        key_mask: torch.Tensor | None = None,
        normalizer: str = "paper",
        eps: float = 1e-6,
) -> torch.Tensor:
    """Multi-head linear attention (paper Eq. 4) on block-major inputs.

    For a query t in block i:
    ``o_t = q_t^T (sum_j W_ij S_j) / (q_t^T (sum_j W_ij z_j) + eps)``.

    Args:
        q: feature-mapped queries ``[B, H, M, T, D]`` (M blocks of T slots).
        k: feature-mapped keys ``[B, H, M, T, D]``.
        v: values ``[B, H, M, T, Dv]``.
        mixing: W ``[M, M]``; row i says how much query block i reads of each key block.
        key_mask: bool ``[B or 1, M, T]``, True for real tokens; other slots are left out of
            every sum (their outputs are still computed and are meaningless).
        normalizer: ``"paper"`` (Eq. 4, rows of the attention matrix sum to 1) or ``"official"``,
            the released code's ``sum_j W_ij (q_{j, pos(t)} . z_j)`` built from the queries of
            *other* blocks at the same in-block position; evenly divided blocks only (no mask).
        eps: added to the denominator.

    Returns:
        ``[B, H, M, T, Dv]`` in the dtype of ``q``.
    """
    if q.ndim != 5 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"expected q, k [B, H, M, T, D] and v [B, H, M, T, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}")
    num_blocks = q.shape[2]
    if mixing.shape != (num_blocks, num_blocks):
        raise ValueError(f"mixing must be [M, M] = [{num_blocks}, {num_blocks}], got {tuple(mixing.shape)}")
    if normalizer not in NORMALIZERS:
        raise ValueError(f"unknown normalizer {normalizer!r}; expected one of {NORMALIZERS}")
    if key_mask is not None and key_mask.shape[-2:] != q.shape[2:4]:
        raise ValueError(f"key_mask must be [B or 1, M, T] with M, T = {tuple(q.shape[2:4])}, "
                         f"got {tuple(key_mask.shape)}")
    if normalizer == "official" and key_mask is not None:
        raise ValueError("normalizer='official' needs evenly divided blocks: key_mask must be None")

    out_dtype = q.dtype
    with _no_autocast(q.device.type):
        q, k, v, mixing = _upcast(q, k, v, mixing)
        if normalizer == "paper":
            mask = None if key_mask is None else key_mask[:, None, :, :, None].to(q.dtype)  # [B | 1, 1, M, T, 1]
            out = _LinearAttentionFunction.apply(q, k, v, mask, mixing, eps)
        else:
            kv = k.transpose(-1, -2) @ v  # [B, H, M, D, Dv]: S_j
            qz = q @ k.sum(-2, keepdim=True).transpose(-1, -2)  # [B, H, M, T, 1]: q_{j,p} . z_j
            out = (q @ _mix(mixing, kv)) / (_mix(mixing, qz) + eps)  # [B, H, M, T, Dv]
    return out.to(out_dtype)


def mhla_attention_parallel(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mixing: torch.Tensor,
        block_ids: torch.Tensor,
        *,
        eps: float = 1e-6,
) -> torch.Tensor:
    """Multi-head linear attention (paper Eq. 4, ``normalizer="paper"``) through the N x N form, token order.

    ``o_t = sum_s W_{b(t) b(s)} (q_t . k_s) v_s / (sum_s W_{b(t) b(s)} (q_t . k_s) + eps)``, the
    same output as ``mhla_attention`` without the block-major layout: blocks of any size, no
    padding. O(N^2) time and memory: for short sequences only.

    Args:
        q: feature-mapped queries ``[B, H, N, D]``.
        k: feature-mapped keys ``[B, H, N, D]``.
        v: values ``[B, H, N, Dv]``.
        mixing: W ``[M, M]``.
        block_ids: long ``[N]``, the block of each token, in ``[0, M)``.
        eps: added to the denominator.

    Returns:
        ``[B, H, N, Dv]`` in the dtype of ``q``.
    """
    _check_token_order(q, k, v)
    if mixing.ndim != 2 or mixing.shape[0] != mixing.shape[1]:
        raise ValueError(f"mixing must be [M, M], got {tuple(mixing.shape)}")
    if block_ids.shape != (q.shape[-2],):
        raise ValueError(f"block_ids must be [N] = [{q.shape[-2]}], got {tuple(block_ids.shape)}")
    out_dtype = q.dtype
    with _no_autocast(q.device.type):
        q, k, v, mixing = _upcast(q, k, v, mixing)
        token_mixing = mixing[block_ids[:, None], block_ids[None, :]]  # [N, N]: W[b(t), b(s)]
        out = _ParallelFunction.apply(q, k, v, token_mixing, eps)  # [B, H, N, Dv]
    return out.to(out_dtype)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Plain (global) linear attention: ``o_t = q_t^T S / (q_t^T z + eps)`` with ``S = K^T V``, ``z = sum_s k_s``.

    Args:
        q: feature-mapped queries ``[B, H, N, D]``.
        k: feature-mapped keys ``[B, H, N, D]``.
        v: values ``[B, H, N, Dv]``.
        eps: added to the denominator.

    Returns:
        ``[B, H, N, Dv]`` in the dtype of ``q``.
    """
    _check_token_order(q, k, v)
    out_dtype = q.dtype
    with _no_autocast(q.device.type):
        q, k, v = _upcast(q, k, v)
        out = _LinearAttentionFunction.apply(q, k, v, None, None, eps)  # [B, H, N, Dv]
    return out.to(out_dtype)
