"""``mhla.fused.qkv_attention``'s whole contract on the kernels: the form's kernel, then LePE.

The parallel form runs ``short_attention``, the block form and plain linear attention ``block_attention``;
LePE stays PyTorch's depthwise convolution (cuDNN on a GPU) of v in ``qkv``, added to the patch tokens' output.
"""
import torch
import torch.nn.functional as F

from ..blocks import BlockLayout
from ..fused import check_arguments, image
from .block import block_attention
from .short import short_attention

__all__ = ["qkv_attention"]


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
    """Linear attention or MHLA (paper normalizer) from ``qkv`` ``[B, N, 3C]`` -> ``[B, N, C]``, on the kernels.

    The arguments, shapes and errors of ``mhla.fused.qkv_attention``; the output is in qkv's dtype, and so
    are LePE's convolution and its addition.
    """
    grid_size = check_arguments(qkv, num_heads, q_weight, k_weight, mixing, layout, parallel, lepe_weight, lepe_bias,
                                grid_size)
    attend = short_attention if parallel else block_attention
    out = attend(qkv, num_heads, q_weight=q_weight, k_weight=k_weight, norm_eps=norm_eps, feature_eps=feature_eps,
                 eps=eps, mixing=mixing, layout=layout)  # [B, N, C]
    if lepe_weight is None:
        return out
    dim, prefix = out.shape[-1], out.shape[1] - grid_size[0] * grid_size[1]
    conv = F.conv2d(image(qkv[..., 2 * dim:], grid_size), lepe_weight.to(qkv.dtype),
                    None if lepe_bias is None else lepe_bias.to(qkv.dtype), padding=lepe_weight.shape[-1] // 2,
                    groups=dim)  # [B, C, gh, gw]
    return torch.cat((out[:, :prefix], out[:, prefix:] + conv.flatten(2).transpose(1, 2)), dim=1)
