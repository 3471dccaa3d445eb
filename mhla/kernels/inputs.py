"""What the kernels take: ``mhla.fused.qkv_attention``'s arguments, and a dtype and head dim Triton can tile."""
import torch

from ..blocks import BlockLayout
from ..fused import check_arguments

__all__ = ["DTYPES", "HEAD_DIMS", "check_inputs"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)  # tl.arange takes powers of two, tl.dot dims of at least 16


def check_inputs(qkv: torch.Tensor, num_heads: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 mixing: torch.Tensor | None, layout: BlockLayout | None, lepe_weight: torch.Tensor | None = None,
                 lepe_bias: torch.Tensor | None = None,
                 grid_size: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """``check_arguments`` (returning its patch grid), then the kernels' own limits; each a one-line ``ValueError``."""
    grid_size = check_arguments(qkv, num_heads, q_weight, k_weight, mixing, layout, False, lepe_weight, lepe_bias,
                                grid_size)
    if qkv.dtype not in DTYPES:
        raise ValueError(f"qkv must be float16, bfloat16 or float32, got {qkv.dtype}")
    head_dim = qkv.shape[-1] // (3 * num_heads)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the head dim must be a power of two from 16 to 128, got C / H = {head_dim}")
    return grid_size
