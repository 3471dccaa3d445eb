"""``mhla.fused.qkv_attention``'s whole contract on the kernels: the parallel form runs ``short_attention``, the
block form and plain linear attention ``block_attention``, each with LePE inside (PyTorch's depthwise convolution).
"""
import torch

from ..blocks import BlockLayout
from ..fused import check_arguments
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

    The arguments, shapes and errors of ``mhla.fused.qkv_attention``; the output is in qkv's dtype, and so is
    LePE's convolution.
    """
    check_arguments(qkv, num_heads, q_weight, k_weight, mixing, layout, parallel)  # the form's kernel checks the rest
    attend = short_attention if parallel else block_attention
    return attend(qkv, num_heads, q_weight=q_weight, k_weight=k_weight, norm_eps=norm_eps, feature_eps=feature_eps,
                  eps=eps, mixing=mixing, layout=layout, lepe_weight=lepe_weight, lepe_bias=lepe_bias,
                  grid_size=grid_size)
