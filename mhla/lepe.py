"""LePE: locally-enhanced positional encoding, a depthwise k x k convolution on V in image layout."""
import torch
from torch import nn

__all__ = ["LePE"]


class LePE(nn.Module):
    """Depthwise ``kernel_size x kernel_size`` convolution over the token grid (odd kernels, same size out).

    Args:
        dim: channels C.
        kernel_size: odd kernel size.
    """

    def __init__(self, dim: int, kernel_size: int = 5, device=None, dtype=None) -> None:
        super().__init__()
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"lepe_kernel must be odd and positive (or 0 for no LePE), got {kernel_size}")
        self.conv = nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim, device=device, dtype=dtype)

    def forward(self, v: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        """``v`` ``[B, N, C]`` in raster order over a ``gh x gw`` grid -> ``[B, N, C]``."""
        batch, num_tokens, channels = v.shape
        x = v.unflatten(1, grid_size).permute(0, 3, 1, 2)  # [B, C, gh, gw], channels-last strides
        return self.conv(x).permute(0, 2, 3, 1).reshape(batch, num_tokens, channels)
