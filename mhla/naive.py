"""Naive references: build the N x N attention matrix A, then return A @ V.

Readable and slow (O(N^2) memory); tests check the fast ops in ``mhla.ops`` against these, and the
analysis code uses the matrices. Inputs are in token order ``[B, H, N, D]``; MHLA's blocks are given
by ``block_ids`` (``[N]``, the block of each token, see ``mhla.blocks.BlockLayout.block_ids``).
Definitions follow ``A[t, s] = W[b(t), b(s)] q_t . k_s / (q_t . z~_{b(t)} + eps)``.
"""
import torch

__all__ = [
    "linear_attention_matrix",
    "mhla_attention_matrix",
    "naive_linear_attention",
    "naive_mhla_attention",
    "naive_qkv_attention",
    "naive_softmax_attention",
    "softmax_attention_matrix",
]


def mhla_attention_matrix(q: torch.Tensor, k: torch.Tensor, mixing: torch.Tensor, block_ids: torch.Tensor, *,
                          key_mask: torch.Tensor | None = None, normalizer: str = "paper",
                          eps: float = 1e-6) -> torch.Tensor:
    """MHLA attention matrix.

    Args:
        q: feature-mapped queries ``[B, H, N, D]``.
        k: feature-mapped keys ``[B, H, N, D]``.
        mixing: W ``[M, M]``.
        block_ids: ``[N]`` long, block of each token, in ``[0, M)``.
        key_mask: bool ``[B or 1, N]``, False for keys left out of every sum.
        normalizer: ``"paper"`` (Eq. 4) or ``"official"`` (the released code; needs blocks of
            equal size, in-block position = order of appearance in the sequence).
        eps: added to the denominator.

    Returns:
        A ``[B, H, N, N]``.
    """
    num_blocks = mixing.shape[0]
    one_hot = torch.nn.functional.one_hot(block_ids, num_blocks).to(k.dtype)  # [N, M]
    if key_mask is not None:
        k = k * key_mask[:, None, :, None].to(k.dtype)
    z = one_hot.T @ k  # [B, H, M, D]: z_j = sum_{s in j} k_s
    z_mixed = mixing @ z  # [B, H, M, D]
    numerator = mixing[block_ids][:, block_ids] * (q @ k.transpose(-1, -2))  # [B, H, N, N]
    if normalizer == "paper":
        den = (q * z_mixed[:, :, block_ids]).sum(-1)  # [B, H, N]: q_t . z~_{b(t)}
    elif normalizer == "official":
        counts = one_hot.sum(0)
        if not bool((counts == counts[0]).all()):
            raise ValueError("normalizer='official' needs blocks of equal size")
        pos = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1).long()  # [N]: in-block position
        token_at = torch.empty(num_blocks, int(counts[0]), dtype=torch.long, device=q.device)
        token_at[block_ids, pos] = torch.arange(q.shape[-2], device=q.device)  # [M, T]
        q_same_pos = q[:, :, token_at[:, pos]]  # [B, H, M, N, D]: q_{j, pos(t)}
        qz = (q_same_pos * z[:, :, :, None, :]).sum(-1)  # [B, H, M, N]
        den = (mixing[block_ids].T * qz).sum(2)  # [B, H, N]: sum_j W_{b(t) j} q_{j,pos(t)} . z_j
    else:
        raise ValueError(f"unknown normalizer {normalizer!r}")
    return numerator / (den[..., None] + eps)


def linear_attention_matrix(q: torch.Tensor, k: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Linear attention matrix ``A[t, s] = q_t . k_s / (q_t . sum_s' k_s' + eps)``; q, k ``[B, H, N, D]``."""
    scores = q @ k.transpose(-1, -2)  # [B, H, N, N]
    den = q @ k.sum(-2, keepdim=True).transpose(-1, -2)  # [B, H, N, 1]
    return scores / (den + eps)


def softmax_attention_matrix(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Softmax attention matrix ``softmax(q k^T * scale)``; q, k ``[B, H, N, D]``, scale defaults to D^-0.5."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)


def naive_mhla_attention(q, k, v, mixing, block_ids, *, key_mask=None, normalizer="paper", eps=1e-6):
    """``mhla_attention_matrix(...) @ v``; v ``[B, H, N, Dv]`` -> ``[B, H, N, Dv]``."""
    a = mhla_attention_matrix(q, k, mixing, block_ids, key_mask=key_mask, normalizer=normalizer, eps=eps)
    return a @ v


def naive_linear_attention(q, k, v, *, eps=1e-6):
    """``linear_attention_matrix(q, k) @ v``; v ``[B, H, N, Dv]`` -> ``[B, H, N, Dv]``."""
    return linear_attention_matrix(q, k, eps=eps) @ v


def naive_softmax_attention(q, k, v, *, scale=None):
    """``softmax_attention_matrix(q, k) @ v``; v ``[B, H, N, Dv]`` -> ``[B, H, N, Dv]``."""
    return softmax_attention_matrix(q, k, scale=scale) @ v


def naive_qkv_attention(qkv, num_heads, *, q_weight=None, k_weight=None, norm_eps=1e-6, feature_eps=1e-6, eps=1e-6,
                        mixing=None, block_ids=None, lepe_weight=None, lepe_bias=None, grid_size=None):
    """``mhla.fused.qkv_attention`` step by step: qkv ``[B, N, 3C]`` -> ``[B, N, C]``.

    q, k, v are split off, q and k go through RMSNorm (weights ``[C]``; none if None) and
    ``ReLU + feature_eps``, then per head (D = C / H) ``naive_linear_attention`` (``mixing`` None) or
    ``naive_mhla_attention`` with W ``[M, M]`` and ``block_ids`` ``[N]``; LePE (``lepe_weight``
    ``[C, 1, k, k]``) adds the depthwise convolution of v over the ``grid_size`` patch grid (the last
    gh * gw tokens).
    """
    q, k, v = qkv.chunk(3, dim=-1)  # [B, N, C] each
    if q_weight is not None:
        q = torch.nn.functional.rms_norm(q, q.shape[-1:], q_weight, norm_eps)
        k = torch.nn.functional.rms_norm(k, k.shape[-1:], k_weight, norm_eps)
    q, k, vh = (t.unflatten(-1, (num_heads, -1)).transpose(1, 2) for t in (q, k, v))  # [B, H, N, D]
    q, k = torch.relu(q) + feature_eps, torch.relu(k) + feature_eps
    if mixing is None:
        out = naive_linear_attention(q, k, vh, eps=eps)
    else:
        out = naive_mhla_attention(q, k, vh, mixing, block_ids, eps=eps)
    out = out.transpose(1, 2).flatten(2)  # [B, N, C]
    if lepe_weight is None:
        return out
    num_patches = grid_size[0] * grid_size[1]
    image = v[:, -num_patches:].transpose(1, 2).unflatten(-1, grid_size)  # [B, C, gh, gw]
    lepe = torch.nn.functional.conv2d(image, lepe_weight, lepe_bias, padding=lepe_weight.shape[-1] // 2,
                                      groups=v.shape[-1])
    lepe = lepe.flatten(2).transpose(1, 2)  # [B, gh * gw, C]
    return torch.cat((out[:, :-num_patches], out[:, -num_patches:] + lepe), dim=1)
