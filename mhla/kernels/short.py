"""MHLA's short-sequence (parallel) form as Triton kernels: tiles of the N x N matrix, never the whole of it.

    A[t, s] = (phi(q_t) . phi(k_s)) W[b(t), b(s)],   o_t = (A V)_t / (sum_s A[t, s] + eps)

the torch path's ``parallel=True`` form (``mhla.ops.parallel_forward``; ``sum_s A[t, s] = phi(q_t) . z~_{b(t)}``,
the paper's Eq. 4 denominator). FlashAttention's loop without the exponential: a program holds one tile of
queries and walks the key tiles (forward, gradient of q) or one tile of keys and walks the query tiles
(gradients of k, v and W). q and k are mapped on load (``mhla.kernels.features``), v is read from ``qkv``
itself. Forward saves ``qkv``, the small parameters and the fp32 denominator ``[B, H, N]``; backward computes,
with ``g = dO / den`` and ``delta_t = g_t . o_t``:

    dA[t, s] = g_t . v_s - delta_t
    d phi(q)_t = sum_s dA[t, s] W phi(k)_s = sum_s (g_t . v_s) W phi(k)_s - delta_t z~_t    (one pass over keys)
    d phi(k)_s = sum_t dA[t, s] W phi(q)_t,   dv_s = sum_t A[t, s] g_t
    dW[i, j] = sum_{t in i, s in j} dA[t, s] (phi(q_t) . phi(k_s))

Every sum is computed by one program in a fixed order (no atomics): W's gradient is summed per key tile as
one-hot matmuls into ``[B * H * tiles, M + G, M + G]`` and then over its first dim in torch, so two runs give
bitwise the same numbers. Operands of ``tl.dot`` are in the input dtype except the one-hot sums of W's
gradient, which are fp32; accumulators are fp32, and fp32 matmuls run in IEEE fp32 (no TF32), as the block
form's.
"""
import torch
import triton
import triton.language as tl

from ..blocks import BlockLayout
from ..fused import lepe_forward_
from ..ops import _no_autocast
from .features import features, features_backward, norm_backward, norm_statistics
from .inputs import check_inputs
from .lepe import lepe_gradients, values

__all__ = ["short_attention"]


@triton.jit
def _phi(qkv, rstd, weight, b, h, rows, N, feature_eps, C: tl.constexpr, D: tl.constexpr, PART: tl.constexpr,
         NORM: tl.constexpr):
    """phi of q (PART 0) or k (PART 1) of head h for tokens ``rows`` of image b: ``[BT, D]`` fp32, 0 past N.

    Also returns what ``features_backward`` needs: the raw tile ``[BT, D]`` and rstd ``[BT]``, weight ``[D]``.
    """
    inside = rows < N
    cols = tl.arange(0, D)
    x = tl.load(qkv + (b * N + rows[:, None]) * 3 * C + PART * C + h * D + cols[None, :], mask=inside[:, None],
                other=0.0)
    r, w = 0.0, 0.0  # not read without NORM
    if NORM:
        r = tl.load(rstd + (b * N + rows) * 2 + PART, mask=inside, other=0.0)
        w = tl.load(weight + PART * C + h * D + cols)
    return tl.where(inside[:, None], features(x, r, w, feature_eps, NORM), 0.0), x, r, w


@triton.jit
def _tile(ptr, b, h, rows, N, STRIDE: tl.constexpr, OFFSET: tl.constexpr, D: tl.constexpr):
    """Head h's ``[BT, D]`` tile of a ``[B, N, STRIDE]`` tensor's columns from OFFSET on, 0 past N."""
    cols = tl.arange(0, D)
    return tl.load(ptr + (b * N + rows[:, None]) * STRIDE + OFFSET + h * D + cols[None, :],
                   mask=(rows < N)[:, None], other=0.0)


@triton.jit
def _store(ptr, value, b, h, rows, N, STRIDE: tl.constexpr, OFFSET: tl.constexpr, D: tl.constexpr):
    """``_tile``'s inverse: ``value`` ``[BT, D]`` into head h's columns, rows past N left out."""
    cols = tl.arange(0, D)
    tl.store(ptr + (b * N + rows[:, None]) * STRIDE + OFFSET + h * D + cols[None, :], value.to(ptr.dtype.element_ty),
             mask=(rows < N)[:, None])


@triton.jit
def _forward_kernel(qkv, rstd, weight, mixing, block_ids, out, den, N, MG, feature_eps, eps, H: tl.constexpr,
                    C: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """One query tile of one (image, head): ``o`` ``[BLOCK_Q, D]`` and its denominator ``[BLOCK_Q]`` (fp32)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    phi_q, x, _, _ = _phi(qkv, rstd, weight, b, h, rows, N, feature_eps, C, D, 0, NORM)
    phi_q = phi_q.to(x.dtype)
    bq = tl.load(block_ids + rows, mask=rows < N, other=0)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    rowsum = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for start in range(0, N, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        phi_k, _, _, _ = _phi(qkv, rstd, weight, b, h, keys, N, feature_eps, C, D, 1, NORM)
        v = _tile(qkv, b, h, keys, N, 3 * C, 2 * C, D)
        bk = tl.load(block_ids + keys, mask=keys < N, other=0)
        mix = tl.load(mixing + bq[:, None] * MG + bk[None, :])  # [BLOCK_Q, BLOCK_K]
        a = tl.dot(phi_q, tl.trans(phi_k.to(x.dtype)), input_precision="ieee") * mix
        acc += tl.dot(a.to(x.dtype), v, input_precision="ieee")
        rowsum += tl.sum(a, 1)
    rowsum += eps
    _store(out, acc / rowsum[:, None], b, h, rows, N, C, 0, D)
    tl.store(den + bh * N + rows, rowsum, mask=rows < N)


@triton.jit
def _grad_q_kernel(qkv, rstd, weight, mixing, block_ids, den, grad_out, grad_qkv, delta, N, MG, feature_eps,
                   H: tl.constexpr, C: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """One query tile: the gradient of q's pre-activation into ``grad_qkv`` ``[B, N, 3, C]`` and delta ``[B, H, N]``.

    One pass over the keys gives ``A V`` (for delta), ``sum_s (g . v_s) W phi(k)_s`` and ``z~ = sum_s W phi(k)_s``.
    """
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    phi_q, x, r, w = _phi(qkv, rstd, weight, b, h, rows, N, feature_eps, C, D, 0, NORM)
    phi_q = phi_q.to(x.dtype)
    bq = tl.load(block_ids + rows, mask=rows < N, other=0)
    d = tl.load(den + bh * N + rows, mask=rows < N, other=1.0)
    g = _tile(grad_out, b, h, rows, N, C, 0, D).to(tl.float32) / d[:, None]  # 0 past N
    g_in = g.to(x.dtype)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    grad_num = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    z_mixed = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    for start in range(0, N, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        phi_k, _, _, _ = _phi(qkv, rstd, weight, b, h, keys, N, feature_eps, C, D, 1, NORM)
        phi_k = phi_k.to(x.dtype)
        v = _tile(qkv, b, h, keys, N, 3 * C, 2 * C, D)
        bk = tl.load(block_ids + keys, mask=keys < N, other=0)
        mix = tl.load(mixing + bq[:, None] * MG + bk[None, :])  # [BLOCK_Q, BLOCK_K]
        a = tl.dot(phi_q, tl.trans(phi_k), input_precision="ieee") * mix
        acc += tl.dot(a.to(x.dtype), v, input_precision="ieee")
        grad_num += tl.dot((tl.dot(g_in, tl.trans(v), input_precision="ieee") * mix).to(x.dtype), phi_k,
                           input_precision="ieee")
        z_mixed += tl.dot(mix.to(x.dtype), phi_k, input_precision="ieee")
    dlt = tl.sum(g * acc, 1) / d  # g . o
    tl.store(delta + bh * N + rows, dlt, mask=rows < N)
    grad = features_backward(grad_num - dlt[:, None] * z_mixed, x, r, w, NORM)
    _store(grad_qkv, grad, b, h, rows, N, 3 * C, 0, D)


@triton.jit
def _grad_kv_kernel(qkv, rstd, weight, mixing, block_ids, den, grad_out, delta, grad_qkv, grad_mixing, N, MG,
                    feature_eps, H: tl.constexpr, C: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr,
                    GRAD_MIXING: tl.constexpr, MG_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """One key tile: the gradients of k's pre-activation and of v into ``grad_qkv``, and this tile's part of W's.

    W's part ``[MG, MG]`` goes to ``grad_mixing[(b * H + h) * tiles + tile]``: ``dA * scores`` summed over the
    queries of each block (a one-hot matmul per query tile), then over the keys of each block.
    """
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    tile = tl.program_id(0)
    keys = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    phi_k, x, r, w = _phi(qkv, rstd, weight, b, h, keys, N, feature_eps, C, D, 1, NORM)
    phi_k = phi_k.to(x.dtype)
    v = _tile(qkv, b, h, keys, N, 3 * C, 2 * C, D)
    bk = tl.load(block_ids + keys, mask=keys < N, other=0)
    blocks = tl.arange(0, MG_PAD)
    grad_k = tl.zeros([BLOCK_K, D], dtype=tl.float32)
    grad_v = tl.zeros([BLOCK_K, D], dtype=tl.float32)
    grad_w = tl.zeros([BLOCK_K, MG_PAD], dtype=tl.float32)  # [s, i]: sum over t in block i of dA[t, s] scores
    for start in range(0, N, BLOCK_Q):
        rows = start + tl.arange(0, BLOCK_Q)
        phi_q, _, _, _ = _phi(qkv, rstd, weight, b, h, rows, N, feature_eps, C, D, 0, NORM)
        phi_q = phi_q.to(x.dtype)
        bq = tl.load(block_ids + rows, mask=rows < N, other=0)
        d = tl.load(den + bh * N + rows, mask=rows < N, other=1.0)
        dlt = tl.load(delta + bh * N + rows, mask=rows < N, other=0.0)
        g = (_tile(grad_out, b, h, rows, N, C, 0, D).to(tl.float32) / d[:, None]).to(x.dtype)
        mix = tl.load(mixing + bq[None, :] * MG + bk[:, None])  # [BLOCK_K, BLOCK_Q]: W[b(t), b(s)] transposed
        scores = tl.dot(phi_k, tl.trans(phi_q), input_precision="ieee")  # [BLOCK_K, BLOCK_Q]
        grad_v += tl.dot((scores * mix).to(x.dtype), g, input_precision="ieee")
        grad_a = tl.dot(v, tl.trans(g), input_precision="ieee") - dlt[None, :]  # dA transposed
        grad_k += tl.dot((grad_a * mix).to(x.dtype), phi_q, input_precision="ieee")
        if GRAD_MIXING:
            one_hot = (bq[:, None] == blocks[None, :]).to(tl.float32)  # [BLOCK_Q, MG_PAD]; 0 past N by scores
            grad_w += tl.dot(grad_a * scores, one_hot, input_precision="ieee")
    _store(grad_qkv, features_backward(grad_k, x, r, w, NORM), b, h, keys, N, 3 * C, C, D)
    _store(grad_qkv, grad_v, b, h, keys, N, 3 * C, 2 * C, D)
    if GRAD_MIXING:
        one_hot = (bk[:, None] == blocks[None, :]).to(tl.float32)  # [BLOCK_K, MG_PAD]; grad_w is 0 past N
        part = tl.dot(tl.trans(grad_w), one_hot, input_precision="ieee")  # [MG_PAD, MG_PAD]: [i, j]
        inside = (blocks[:, None] < MG) & (blocks[None, :] < MG)
        tl.store(grad_mixing + (bh * tl.num_programs(0) + tile) * MG * MG + blocks[:, None] * MG + blocks[None, :],
                 part, mask=inside)


def _block_size(num_tokens: int) -> int:
    """Query and key tile length: a power of two from 16 (``tl.dot``'s least) to 64, no longer than needed."""
    return min(64, max(16, triton.next_power_of_2(num_tokens)))


class _ShortAttentionFunction(torch.autograd.Function):
    """``short_attention``'s kernels with their hand-written backward; keeps qkv, the weights and the denominator."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, mixing, lepe_weight, lepe_bias, block_ids, grid_size, num_heads, norm_eps,
                feature_eps, eps):
        batch, num_tokens, dim = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        out = qkv.new_empty(batch, num_tokens, dim)
        # the denominator [B, H, N] and, in backward, delta beside it: one allocation for both
        stats = torch.empty(2, batch, num_heads, num_tokens, dtype=torch.float32, device=qkv.device)
        den = stats[0]
        rstd = weight = None
        if q_weight is not None:  # computed once, kept for backward: [B, N, 2] and [2, C], small
            rstd, weight = norm_statistics(qkv, norm_eps), torch.stack((q_weight, k_weight)).float()
        block = _block_size(num_tokens)
        grid = (triton.cdiv(num_tokens, block), batch * num_heads)
        _forward_kernel[grid](qkv, rstd, weight, mixing, block_ids, out, den, num_tokens, mixing.shape[0], feature_eps,
                              eps, H=num_heads, C=dim, D=dim // num_heads, NORM=q_weight is not None, BLOCK_Q=block,
                              BLOCK_K=block)
        if lepe_weight is not None:
            lepe_forward_(out, values(qkv), lepe_weight, lepe_bias, grid_size)
        ctx.save_for_backward(qkv, q_weight, k_weight, mixing, lepe_weight, block_ids, stats, rstd, weight)
        ctx.num_heads, ctx.feature_eps = num_heads, feature_eps
        ctx.grid_size, ctx.has_bias = grid_size, lepe_bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, q_weight, k_weight, mixing, lepe_weight, block_ids, stats, rstd, weight = ctx.saved_tensors
        den, delta = stats.unbind(0)  # [B, H, N] each
        num_heads, needs = ctx.num_heads, ctx.needs_input_grad
        batch, num_tokens, dim = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        grad_out = grad_out.contiguous()
        grad_qkv = torch.empty(batch, num_tokens, 3, dim, dtype=torch.float32, device=qkv.device)
        block = _block_size(num_tokens)
        tiles = triton.cdiv(num_tokens, block)
        blocks = mixing.shape[0]
        padded = max(16, triton.next_power_of_2(blocks))  # tl.arange's and tl.dot's
        grad_mixing = torch.empty(batch * num_heads * tiles if needs[3] else 0, blocks, blocks, dtype=torch.float32,
                                  device=qkv.device)
        common = dict(H=num_heads, C=dim, D=dim // num_heads, NORM=q_weight is not None, BLOCK_Q=block,
                      BLOCK_K=block)
        _grad_q_kernel[(tiles, batch * num_heads)](qkv, rstd, weight, mixing, block_ids, den, grad_out, grad_qkv,
                                                   delta, num_tokens, blocks, ctx.feature_eps, **common)
        _grad_kv_kernel[(tiles, batch * num_heads)](qkv, rstd, weight, mixing, block_ids, den, grad_out, delta,
                                                    grad_qkv, grad_mixing, num_tokens, blocks, ctx.feature_eps,
                                                    GRAD_MIXING=needs[3], MG_PAD=padded, **common)
        grad_q_weight = grad_k_weight = None
        if q_weight is not None:
            grad_weight = norm_backward(grad_qkv, qkv, rstd, weight)  # [2, C]
            grad_q_weight, grad_k_weight = grad_weight.to(q_weight.dtype).unbind(0)
        grad_mixing = grad_mixing.sum(0).to(mixing.dtype) if needs[3] else None
        grad_lepe = lepe_gradients(grad_qkv, grad_out, qkv, lepe_weight, ctx.has_bias, ctx.grid_size, needs[4:6])
        return (grad_qkv.flatten(2).to(qkv.dtype), grad_q_weight, grad_k_weight, grad_mixing, *grad_lepe, None, None,
                None, None, None, None)


def short_attention(
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
        lepe_weight: torch.Tensor | None = None,
        lepe_bias: torch.Tensor | None = None,
        grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Linear attention or MHLA (paper normalizer) in the parallel form, as Triton kernels.

    The contract of ``mhla.fused.qkv_attention`` for these arguments; LePE is PyTorch's depthwise convolution
    (cuDNN on a GPU) inside the same autograd function, as on the torch path.

    Args:
        qkv: ``[B, N, 3C]``, q, k and v side by side, N tokens in the order of ``layout``.
        num_heads: H; the head dim D = C / H must be a power of two from 16 to 128.
        q_weight, k_weight: ``[C]`` RMSNorm weights of q and k; None (both) for no q/k norm.
        norm_eps: the RMSNorm epsilon; None is the dtype's epsilon (fp32's for fp16/bf16 inputs).
        feature_eps: the feature map's offset, ``phi(x) = ReLU(x) + feature_eps``.
        eps: added to the denominator ``sum_s A[t, s]``.
        mixing: None for plain linear attention; W ``[M + G, M + G]`` over the layout's blocks for MHLA.
        layout: MHLA's block layout (``mhla.blocks.block_layout``), on qkv's device.
        lepe_weight, lepe_bias, grid_size: LePE, as ``mhla.fused.qkv_attention`` takes it.

    Returns:
        ``[B, N, C]`` in the dtype of ``qkv``; differentiable w.r.t. qkv, q_weight, k_weight and mixing.
    """
    grid_size = check_inputs(qkv, num_heads, q_weight, k_weight, mixing, layout, lepe_weight, lepe_bias, grid_size)
    num_tokens = qkv.shape[1]
    if layout is None:
        mixing = torch.ones(1, 1, dtype=torch.float32, device=qkv.device)
        block_ids = torch.zeros(num_tokens, dtype=torch.int32, device=qkv.device)
    else:
        block_ids = layout.block_ids  # int64, read as it is
    with _no_autocast(qkv.device.type):
        return _ShortAttentionFunction.apply(qkv.contiguous(), q_weight, k_weight, mixing.float().contiguous(),
                                             lepe_weight, lepe_bias, block_ids, grid_size, num_heads, norm_eps,
                                             feature_eps, eps)
