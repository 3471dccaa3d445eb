"""Token grid <-> block grid layout.

Patch tokens come in raster order from a ``gh x gw`` grid. MHLA cuts that grid into a ``bh x bw``
grid of blocks (M = bh * bw) and processes the tokens *block-major*: ``[..., M, T, D]`` with T
slots per block. When the grid does not split evenly, blocks are unequal; every block then gets
T = (largest block) slots and the unused slots are marked in ``mask`` so that the attention op
leaves them out of every sum.

Two ways to cut a side of length ``g`` into ``b`` parts:

- ``"balanced"`` (default): like ``torch.tensor_split``; the first ``g % b`` parts are one token
  longer. 14 tokens into 4 blocks -> 4, 4, 3, 3.
- ``"pad"``: the released code's even split; the grid is padded at the bottom/right to a multiple
  of ``b``, every block is ``ceil(g / b)`` long, the last ones hold the padding. 14 into 4 -> 4, 4,
  4, 2.

Prefix tokens (class or register tokens placed before the patch tokens) go into extra blocks of
their own, appended after the M patch blocks (see ``MultiHeadLinearAttention`` for how they mix).
"""
import dataclasses
import math
from dataclasses import dataclass

import torch

__all__ = ["BlockLayout", "block_layout", "split_sizes"]

MODES = ("balanced", "pad")


def split_sizes(length: int, parts: int, mode: str = "balanced") -> list[int]:
    """Lengths of ``parts`` consecutive pieces of a side of ``length`` tokens (padding included)."""
    if mode == "balanced":
        return [length // parts + (1 if i < length % parts else 0) for i in range(parts)]
    if mode == "pad":
        return [math.ceil(length / parts)] * parts
    raise ValueError(f"unknown block mode {mode!r}; expected one of {MODES}")


@dataclass(frozen=True)
class BlockLayout:
    """Where each token sits in the block-major layout; its tensors live on one device.

    Attributes:
        grid_size: token grid ``(gh, gw)``.
        block_grid: block grid ``(bh, bw)``.
        num_prefix_tokens: P tokens before the patch tokens.
        num_blocks: M, patch blocks.
        num_prefix_blocks: G = ceil(P / T), blocks holding the prefix tokens.
        block_size: T, slots per block.
        index: ``[(M + G) * T]`` token index read into each slot (0 for unused slots).
        inverse: ``[N]`` slot of each token, N = P + gh * gw.
        mask: ``[M + G, T]`` bool, True where a slot holds a real token.
        block_ids: ``[N]`` block of each token (prefix blocks numbered M..M+G-1).
        evenly_divided: True when every slot holds a real token (no mask needed).
    """

    grid_size: tuple[int, int]
    block_grid: tuple[int, int]
    num_prefix_tokens: int
    num_blocks: int
    num_prefix_blocks: int
    block_size: int
    index: torch.Tensor
    inverse: torch.Tensor
    mask: torch.Tensor
    block_ids: torch.Tensor
    evenly_divided: bool
    @property
    def num_tokens(self) -> int:
        return self.inverse.numel()

    @property
    def is_regular(self) -> bool:
        """Equal blocks and no prefix tokens: block-major order is a reshape and transpose, no gather."""
        return self.evenly_divided and self.num_prefix_tokens == 0

    def to_blocks(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """``[..., N, ...]`` tokens along ``dim`` -> ``[..., M + G, T, ...]`` block-major (a copy)."""
        dim = dim % x.ndim
        if self.is_regular:
            (gh, gw), (bh, bw) = self.grid_size, self.block_grid
            x = x.unflatten(dim, (bh, gh // bh, bw, gw // bw)).transpose(dim + 1, dim + 2)  # [.., bh, bw, th, tw, ..]
            return x.flatten(dim + 2, dim + 3).flatten(dim, dim + 1).contiguous()
        x = x.index_select(dim, self.index)
        return x.unflatten(dim, (self.num_blocks + self.num_prefix_blocks, self.block_size))

    def from_blocks(self, x: torch.Tensor, dim: int = -3, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., M + G, T, ...]`` block-major along ``dim, dim + 1`` -> ``[..., N, ...]`` tokens (a copy).

        ``out``: the ``[..., N, ...]`` tensor to write into (any strides) instead of a new one.
        """
        dim = dim % x.ndim
        if self.is_regular:
            (gh, gw), (bh, bw) = self.grid_size, self.block_grid
            x = x.unflatten(dim + 1, (gh // bh, gw // bw)).unflatten(dim, (bh, bw)).transpose(dim + 1, dim + 2)
            if out is None:
                return x.flatten(dim, dim + 3)
            out.unflatten(dim, x.shape[dim:dim + 4]).copy_(x)  # [..., bh, th, bw, tw, ...], a view of out
            return out
        x = x.flatten(dim, dim + 1).index_select(dim, self.inverse)
        return x if out is None else out.copy_(x)


_LAYOUTS: dict[tuple, BlockLayout] = {}  # the one cache of layouts, keyed by every argument of block_layout


def block_layout(
        grid_size: tuple[int, int],
        block_grid: tuple[int, int],
        mode: str = "balanced",
        num_prefix_tokens: int = 0,
        device: torch.device | str | None = None,
) -> BlockLayout:
    """The layout of a ``gh x gw`` token grid cut into ``bh x bw`` blocks, its tensors on ``device`` (CPU).

    Built once per set of arguments and cached; a cached layout is a dictionary lookup, which
    ``torch.compile`` traces without a graph break (building one is kept out of the graph).

    Raises:
        ValueError: a block grid larger than the token grid, a non-positive size, an unknown mode.
    """
    key = (tuple(grid_size), tuple(block_grid), mode, num_prefix_tokens, torch.device(device or "cpu"))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = _build(*key)
    return layout


@torch.compiler.disable
def _build(grid_size: tuple[int, int], block_grid: tuple[int, int], mode: str, num_prefix_tokens: int,
           device: torch.device) -> BlockLayout:
    """A new layout: computed on the CPU, then (for another device) copied from the cached CPU one."""
    if device.type != "cpu":
        cpu = block_layout(grid_size, block_grid, mode, num_prefix_tokens)
        return dataclasses.replace(cpu, index=cpu.index.to(device), inverse=cpu.inverse.to(device),
                                   mask=cpu.mask.to(device), block_ids=cpu.block_ids.to(device))
    (gh, gw), (bh, bw) = tuple(grid_size), tuple(block_grid)
    if min(gh, gw) < 1 or min(bh, bw) < 1:
        raise ValueError(f"grid sizes must be positive, got grid_size={grid_size}, block_grid={block_grid}")
    if bh > gh or bw > gw:
        raise ValueError(f"block_grid {bh}x{bw} is larger than the token grid {gh}x{gw}")
    if num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
    heights, widths = split_sizes(gh, bh, mode), split_sizes(gw, bw, mode)
    th, tw = max(heights), max(widths)
    num_blocks, block_size = bh * bw, th * tw
    num_prefix_blocks = math.ceil(num_prefix_tokens / block_size)
    total_blocks = num_blocks + num_prefix_blocks

    index = torch.zeros(total_blocks, block_size, dtype=torch.long, device="cpu")
    mask = torch.zeros(total_blocks, block_size, dtype=torch.bool, device="cpu")
    row0 = [sum(heights[:i]) for i in range(bh)]
    col0 = [sum(widths[:j]) for j in range(bw)]
    for bi in range(bh):
        for bj in range(bw):
            block = bi * bw + bj
            for r in range(th):
                for c in range(tw):
                    row, col = row0[bi] + r, col0[bj] + c
                    if r < heights[bi] and c < widths[bj] and row < gh and col < gw:
                        index[block, r * tw + c] = num_prefix_tokens + row * gw + col
                        mask[block, r * tw + c] = True
    for p in range(num_prefix_tokens):
        index[num_blocks + p // block_size, p % block_size] = p
        mask[num_blocks + p // block_size, p % block_size] = True

    slots = torch.arange(total_blocks * block_size, device="cpu")[mask.flatten()]
    inverse = torch.empty(num_prefix_tokens + gh * gw, dtype=torch.long, device="cpu")
    inverse[index.flatten()[mask.flatten()]] = slots
    block_ids = torch.div(inverse, block_size, rounding_mode="floor")
    return BlockLayout(
        grid_size=(gh, gw),
        block_grid=(bh, bw),
        num_prefix_tokens=num_prefix_tokens,
        num_blocks=num_blocks,
        num_prefix_blocks=num_prefix_blocks,
        block_size=block_size,
        index=index.flatten(),
        inverse=inverse,
        mask=mask,
        block_ids=block_ids,
        evenly_divided=bool(mask.all()),
    )
