"""The block form of MHLA (plain linear attention as one block of all tokens) in Triton, forward and backward.

    qkv [B, N, 3C] -> phi(q), phi(k), v per head (D = C / H, ``features`` on load)
        S_j = phi(K_j)^T V_j [D, D],  z_j = sum_{t in j} phi(k_t) [D]        (_summaries_kernel)
        S~ = W S,  z~ = W z                                                   (torch, fp32)
        o_t = phi(q_t) S~_{b(t)} / (phi(q_t) . z~_{b(t)} + eps)               (_output_kernel)

The blocks are those of a ``mhla.blocks.BlockLayout`` (M patch blocks, then G prefix blocks, T slots each);
a program reads its block's tokens through the layout's index, straight from ``qkv``, and writes the output at
the tokens' rows. Backward recomputes the summaries (cheaper than keeping ``[B, H, M + G, D, D]``) and goes the
same two ways round: per query block, the gradient of phi(q) and the block's dS~_i = phi(Q_i)^T G_i and
dz~_i, each summed by one program; then in torch dS = W^T dS~, dz = W^T dz~ and dW; per key block, the
gradients of phi(k) and v. Every sum is computed by one program in a fixed order, so that two runs agree
bitwise. fp32 matmuls run in IEEE fp32 (no TF32). The naive reference is ``mhla.naive.naive_qkv_attention``.
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

__all__ = ["block_attention"]

BLOCK_T = 16  # token slots per tile


@triton.jit
def _slots(slots, block, start, T, b, N, BLOCK_T: tl.constexpr):
    """The rows ``[BLOCK_T]`` (int64, of ``[B * N, ...]``) of slots ``start..`` of ``block``, and which are tokens."""
    slot = start + tl.arange(0, BLOCK_T)
    token = tl.load(slots + block * T + slot, mask=slot < T, other=-1)
    valid = token >= 0
    return (b * N + tl.where(valid, token, 0)).to(tl.int64), valid


@triton.jit
def _load(qkv, rows, valid, h, PART: tl.constexpr, C: tl.constexpr, D: tl.constexpr):
    """The ``[BLOCK_T, D]`` tile of q (``PART`` 0), k (1) or v (2) of head h at ``rows``; 0 where not ``valid``."""
    cols = tl.arange(0, D)
    return tl.load(qkv + rows[:, None] * (3 * C) + PART * C + h * D + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _phi(qkv, rstd, weight, rows, valid, h, feature_eps, PART: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
         NORM: tl.constexpr):
    """phi of q (``PART`` 0) or k (1) of head h at ``rows``, ``[BLOCK_T, D]`` fp32, 0 where not ``valid``.

    Also returns what ``features_backward`` needs: the raw tile, RMSNorm's r ``[BLOCK_T]`` and w ``[D]`` (zeros
    without ``NORM``).
    """
    x = _load(qkv, rows, valid, h, PART, C, D)
    if NORM:
        r = tl.load(rstd + rows * 2 + PART, mask=valid, other=0.0)
        w = tl.load(weight + PART * C + h * D + tl.arange(0, D)).to(tl.float32)
    else:
        r = tl.zeros(rows.shape, tl.float32)
        w = tl.zeros([D], tl.float32)
    return tl.where(valid[:, None], features(x, r, w, feature_eps, NORM), 0.0), x, r, w


@triton.jit
def _summaries_kernel(qkv, rstd, weight, slots, kv, ksum, feature_eps, N, T, H, C: tl.constexpr, D: tl.constexpr,
                      BLOCK_T: tl.constexpr, NORM: tl.constexpr):
    """Program (j, b H + h): ``S_j`` ``[D, D]`` and ``z_j`` ``[D]`` of head h into kv, ksum (fp32)."""
    j, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    acc = tl.zeros([D, D], tl.float32)
    acc_z = tl.zeros([D], tl.float32)
    for start in range(0, T, BLOCK_T):
        rows, valid = _slots(slots, j, start, T, b, N, BLOCK_T)
        k, x, r, w = _phi(qkv, rstd, weight, rows, valid, h, feature_eps, 1, C, D, NORM)  # [BLOCK_T, D]
        v = _load(qkv, rows, valid, h, 2, C, D)
        acc = tl.dot(tl.trans(k.to(v.dtype)), v, acc, input_precision="ieee")
        acc_z += tl.sum(k, 0)
    block = bh * tl.num_programs(0) + j
    dd = tl.arange(0, D)
    tl.store(kv + (block * D + dd[:, None]) * D + dd[None, :], acc)
    tl.store(ksum + block * D + dd, acc_z)


@triton.jit
def _output_kernel(qkv, rstd, weight, slots, kv, ksum, out, feature_eps, eps, N, T, H, C: tl.constexpr,
                   D: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr):
    """Program (i, b H + h): ``o = phi(q) S~_i / (phi(q) . z~_i + eps)`` of block i's tokens, head h, into out."""
    i, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    block = bh * tl.num_programs(0) + i
    dd = tl.arange(0, D)
    s = tl.load(kv + (block * D + dd[:, None]) * D + dd[None, :])  # [D, D] fp32: S~_i
    z = tl.load(ksum + block * D + dd)  # [D]: z~_i
    for start in range(0, T, BLOCK_T):
        rows, valid = _slots(slots, i, start, T, b, N, BLOCK_T)
        q, x, r, w = _phi(qkv, rstd, weight, rows, valid, h, feature_eps, 0, C, D, NORM)  # [BLOCK_T, D]
        num = tl.dot(q.to(x.dtype), s.to(x.dtype), input_precision="ieee")
        den = tl.sum(q * z[None, :], 1) + eps
        o = num / den[:, None]
        tl.store(out + rows[:, None] * C + h * D + dd[None, :], o.to(out.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _query_backward_kernel(qkv, rstd, weight, slots, kv, ksum, grad_out, grad, grad_kv, grad_ksum, feature_eps, eps,
                           N, T, H, C: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr):
    """Program (i, b H + h): q's pre-activation gradient into grad's q slot, dS~_i and dz~_i into grad_kv, grad_ksum.

    With g = dO / den: ``d phi(q) = g S~^T - (g . o) z~``, ``dS~_i = phi(Q)^T G``, ``dz~_i = -sum phi(q) (g . o)``.
    """
    i, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    block = bh * tl.num_programs(0) + i
    dd = tl.arange(0, D)
    s = tl.load(kv + (block * D + dd[:, None]) * D + dd[None, :])
    z = tl.load(ksum + block * D + dd)
    acc = tl.zeros([D, D], tl.float32)
    acc_z = tl.zeros([D], tl.float32)
    for start in range(0, T, BLOCK_T):
        rows, valid = _slots(slots, i, start, T, b, N, BLOCK_T)
        q, x, r, w = _phi(qkv, rstd, weight, rows, valid, h, feature_eps, 0, C, D, NORM)  # [BLOCK_T, D]
        at = rows[:, None] * C + h * D + dd[None, :]
        dout = tl.load(grad_out + at, mask=valid[:, None], other=0.0)
        den = tl.sum(q * z[None, :], 1) + eps
        o = tl.dot(q.to(x.dtype), s.to(x.dtype), input_precision="ieee") / den[:, None]
        g = dout.to(tl.float32) / den[:, None]  # [BLOCK_T, D]
        g_o = tl.sum(g * o, 1)  # [BLOCK_T]
        dq = tl.dot(g.to(x.dtype), tl.trans(s.to(x.dtype)), input_precision="ieee") - g_o[:, None] * z[None, :]
        tl.store(grad + rows[:, None] * (3 * C) + h * D + dd[None, :], features_backward(dq, x, r, w, NORM),
                 mask=valid[:, None])
        acc = tl.dot(tl.trans(q.to(x.dtype)), g.to(x.dtype), acc, input_precision="ieee")
        acc_z -= tl.sum(q * g_o[:, None], 0)
    tl.store(grad_kv + (block * D + dd[:, None]) * D + dd[None, :], acc)
    tl.store(grad_ksum + block * D + dd, acc_z)


@triton.jit
def _key_backward_kernel(qkv, rstd, weight, slots, grad_kv, grad_ksum, grad, feature_eps, N, T, H, C: tl.constexpr,
                         D: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr):
    """Program (j, b H + h): k's pre-activation gradient and v's gradient into grad's k and v slots.

    ``d phi(k) = V dS_j^T + dz_j``, ``dv = phi(K) dS_j``, with dS_j, dz_j the gradients of S_j, z_j.
    """
    j, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    block = bh * tl.num_programs(0) + j
    dd = tl.arange(0, D)
    ds = tl.load(grad_kv + (block * D + dd[:, None]) * D + dd[None, :])
    dz = tl.load(grad_ksum + block * D + dd)
    for start in range(0, T, BLOCK_T):
        rows, valid = _slots(slots, j, start, T, b, N, BLOCK_T)
        k, x, r, w = _phi(qkv, rstd, weight, rows, valid, h, feature_eps, 1, C, D, NORM)  # [BLOCK_T, D]
        v = _load(qkv, rows, valid, h, 2, C, D)
        dk = tl.dot(v, tl.trans(ds.to(v.dtype)), input_precision="ieee") + dz[None, :]
        dv = tl.dot(k.to(v.dtype), ds.to(v.dtype), input_precision="ieee")
        at = rows[:, None] * (3 * C) + h * D + dd[None, :]
        tl.store(grad + at + C, features_backward(dk, x, r, w, NORM), mask=valid[:, None])
        tl.store(grad + at + 2 * C, dv, mask=valid[:, None])


def _slot_tokens(layout: BlockLayout | None, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """The token of each slot (-1 for padding) int32 ``[(M + G) * T]``, M + G and T; all tokens one block if None."""
    if layout is None:
        return torch.arange(num_tokens, dtype=torch.int32, device=device), 1, num_tokens
    slots = torch.where(layout.mask.flatten(), layout.index, -1).to(device=device, dtype=torch.int32)
    return slots, layout.num_blocks + layout.num_prefix_blocks, layout.block_size


def _mix(mixing: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``sum_j W_ij x_j`` over the blocks of x ``[B, H, M + G, ...]`` (contiguous); x itself without mixing."""
    return x if mixing is None else torch.einsum("ij,bhj...->bhi...", mixing, x).contiguous()


class _Run:
    """What every launch of one call shares: the sizes, the norm's statistics and weights, the slots."""

    def __init__(self, qkv, norm, mixing, layout, num_heads, feature_eps):
        self.qkv, self.feature_eps = qkv, feature_eps
        self.batch, self.tokens, self.dim = qkv.shape[0], qkv.shape[1], qkv.shape[-1] // 3
        self.rstd, self.weight = norm  # [B, N, 2] and [2, C] fp32, or None, None
        self.mixing = None if mixing is None else mixing.float()
        self.slots, self.blocks, block_size = _slot_tokens(layout, self.tokens, qkv.device)
        self.heads, self.head_dim = num_heads, self.dim // num_heads
        self.sizes = (self.tokens, block_size, num_heads)  # N, T, H
        self.meta = dict(C=self.dim, D=self.head_dim, BLOCK_T=BLOCK_T, NORM=self.weight is not None)

    def summaries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """S ``[B, H, M + G, D, D]`` and z ``[B, H, M + G, D]``, fp32, unmixed."""
        shape = (self.batch, self.heads, self.blocks, self.head_dim)
        kv = torch.empty(*shape, self.head_dim, dtype=torch.float32, device=self.qkv.device)
        ksum = torch.empty(shape, dtype=torch.float32, device=self.qkv.device)
        grid = (self.blocks, self.batch * self.heads)  # (j, b H + h)
        _summaries_kernel[grid](self.qkv, self.rstd, self.weight, self.slots, kv, ksum, self.feature_eps, *self.sizes,
                                **self.meta)
        return kv, ksum


class _BlockAttentionFunction(torch.autograd.Function):
    """The kernels' forward and backward; keeps ``qkv`` and the small parameters, recomputes the summaries."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, mixing, lepe_weight, lepe_bias, layout, grid_size, num_heads, norm_eps,
                feature_eps, eps):
        norm = (None, None)
        if q_weight is not None:  # computed once, kept for backward: [B, N, 2] and [2, C], small
            norm = (norm_statistics(qkv, norm_eps), torch.stack((q_weight, k_weight)).float())
        ctx.save_for_backward(qkv, q_weight, k_weight, mixing, lepe_weight, *norm)
        ctx.options, ctx.eps = (layout, num_heads, feature_eps), eps
        ctx.grid_size, ctx.has_bias = grid_size, lepe_bias is not None
        run = _Run(qkv, norm, mixing, *ctx.options)
        kv, ksum = run.summaries()
        out = torch.empty(run.batch, run.tokens, run.dim, dtype=qkv.dtype, device=qkv.device)  # [B, N, C]
        grid = (run.blocks, run.batch * run.heads)  # (i, b H + h)
        _output_kernel[grid](qkv, run.rstd, run.weight, run.slots, _mix(run.mixing, kv), _mix(run.mixing, ksum), out,
                             feature_eps, eps, *run.sizes, **run.meta)
        if lepe_weight is not None:
            lepe_forward_(out, values(qkv), lepe_weight, lepe_bias, grid_size)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, q_weight, k_weight, mixing, lepe_weight, rstd, weight = ctx.saved_tensors
        run = _Run(qkv, (rstd, weight), mixing, *ctx.options)
        kv, ksum = run.summaries()
        grad_out = grad_out.contiguous()
        grad = torch.empty(run.batch, run.tokens, 3, run.dim, dtype=torch.float32, device=qkv.device)  # [B, N, 3, C]
        grad_kv, grad_ksum = torch.empty_like(kv), torch.empty_like(ksum)
        grid = (run.blocks, run.batch * run.heads)  # (i, b H + h), then (j, b H + h)
        _query_backward_kernel[grid](qkv, run.rstd, run.weight, run.slots, _mix(run.mixing, kv), _mix(run.mixing, ksum),
                                     grad_out, grad, grad_kv, grad_ksum, run.feature_eps, ctx.eps, *run.sizes,
                                     **run.meta)
        grad_mixing = None
        if mixing is not None:
            if ctx.needs_input_grad[3]:
                grad_mixing = (torch.einsum("bhide,bhjde->ij", grad_kv, kv)
                               + torch.einsum("bhid,bhjd->ij", grad_ksum, ksum)).to(mixing.dtype)
            grad_kv, grad_ksum = _mix(run.mixing.t(), grad_kv), _mix(run.mixing.t(), grad_ksum)
        _key_backward_kernel[grid](qkv, run.rstd, run.weight, run.slots, grad_kv, grad_ksum, grad, run.feature_eps,
                                   *run.sizes, **run.meta)
        grad_q_weight = grad_k_weight = None
        if run.weight is not None:
            grad_weight = norm_backward(grad, qkv, run.rstd, run.weight)  # [2, C]
            grad_q_weight, grad_k_weight = grad_weight.to(q_weight.dtype).unbind(0)
        grad_lepe = lepe_gradients(grad, grad_out, qkv, lepe_weight, ctx.has_bias, ctx.grid_size,
                                   ctx.needs_input_grad[4:6])
        return (grad.flatten(2).to(qkv.dtype), grad_q_weight, grad_k_weight, grad_mixing, *grad_lepe, None, None, None,
                None, None, None)


def block_attention(
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
    """Linear attention or MHLA (paper normalizer, block form) from the qkv projection's output, in Triton.

    ``mhla.fused.qkv_attention``'s contract but for the parallel form; LePE is PyTorch's depthwise convolution
    (cuDNN on a GPU) inside the same autograd function, as on the torch path.

    Args:
        qkv: ``[B, N, 3C]`` fp16, bf16 or fp32, q, k and v side by side, N tokens in the order of ``layout``.
        num_heads: H; the head dim D = C / H must be a power of two from 16 to 128.
        q_weight, k_weight: ``[C]`` RMSNorm weights of q and k; None (both) for no q/k norm.
        norm_eps: the RMSNorm epsilon; None is the dtype's epsilon.
        feature_eps: the feature map's offset, ``phi(x) = ReLU(x) + feature_eps``.
        eps: added to the denominator.
        mixing: None for plain linear attention; W ``[M + G, M + G]`` over the layout's blocks for MHLA.
        layout: MHLA's block layout (``mhla.blocks.block_layout``).
        lepe_weight, lepe_bias, grid_size: LePE, as ``mhla.fused.qkv_attention`` takes it.

    Returns:
        ``[B, N, C]`` in the dtype of ``qkv``, differentiable w.r.t. qkv, the norm weights, the mixing and LePE.
    """
    grid_size = check_inputs(qkv, num_heads, q_weight, k_weight, mixing, layout, lepe_weight, lepe_bias, grid_size)
    with _no_autocast(qkv.device.type):
        return _BlockAttentionFunction.apply(qkv.contiguous(), q_weight, k_weight, mixing, lepe_weight, lepe_bias,
                                             layout, grid_size, num_heads, norm_eps, feature_eps, eps)
