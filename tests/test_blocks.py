"""Token grid <-> block grid layouts."""
import pytest
import torch

from mhla import MultiHeadLinearAttention
from mhla.blocks import block_layout, split_sizes


@pytest.mark.parametrize("grid,block_grid,mode", [
    ((14, 14), (4, 4), "balanced"), ((14, 14), (4, 4), "pad"), ((7, 9), (2, 3), "balanced"),
    ((16, 16), (4, 4), "balanced"), ((5, 3), (1, 1), "balanced"), ((7, 9), (7, 9), "pad"),
])
@pytest.mark.parametrize("num_prefix_tokens", [0, 1, 4])
def test_round_trip_and_block_membership(grid, block_grid, mode, num_prefix_tokens):
    layout = block_layout(grid, block_grid, mode, num_prefix_tokens)
    n = num_prefix_tokens + grid[0] * grid[1]
    x = torch.randn(2, 3, n, 5)
    blocks = layout.to_blocks(x)
    assert blocks.shape == (2, 3, layout.num_blocks + layout.num_prefix_blocks, layout.block_size, 5)
    assert torch.equal(layout.from_blocks(blocks), x)
    assert int(layout.mask.sum()) == n
    # every patch token sits in the block that contains its grid cell
    gh, gw = grid
    bh, bw = block_grid
    rows = torch.tensor(split_sizes(gh, bh, mode)).cumsum(0)
    cols = torch.tensor(split_sizes(gw, bw, mode)).cumsum(0)
    for token in range(gh * gw):
        r, c = divmod(token, gw)
        expected = int((rows <= r).sum()) * bw + int((cols <= c).sum())
        assert layout.block_ids[num_prefix_tokens + token] == expected
    assert (layout.block_ids[:num_prefix_tokens] >= layout.num_blocks).all()


def test_fourteen_into_four_blocks():
    balanced = block_layout((14, 14), (4, 4))
    assert split_sizes(14, 4) == [4, 4, 3, 3]
    assert balanced.block_size == 16
    assert balanced.mask.sum(1).tolist() == [16, 16, 12, 12] * 2 + [12, 12, 9, 9] * 2
    padded = block_layout((14, 14), (4, 4), "pad")
    assert split_sizes(14, 4, "pad") == [4, 4, 4, 4]
    assert padded.mask.sum(1).tolist() == [16, 16, 16, 8] * 3 + [8, 8, 8, 4]
    assert not balanced.evenly_divided and block_layout((16, 16), (4, 4)).evenly_divided


def test_block_major_order_is_raster_inside_each_block():
    layout = block_layout((4, 4), (2, 2))
    tokens = torch.arange(16).view(1, 16, 1).float()
    blocks = layout.to_blocks(tokens).squeeze(-1)
    assert blocks[0, 0].tolist() == [0, 1, 4, 5]
    assert blocks[0, 3].tolist() == [10, 11, 14, 15]


def test_prefix_tokens_fill_their_own_blocks():
    layout = block_layout((4, 4), (2, 2), num_prefix_tokens=6)
    assert layout.num_prefix_blocks == 2
    assert layout.mask[4:].sum() == 6
    x = torch.arange(22).view(1, 22, 1).float()
    prefix = layout.to_blocks(x)[0, 4:].flatten()[layout.mask[4:].flatten()]
    assert prefix.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("grid,block_grid,prefix,mode,match", [
    ((3, 3), (4, 1), 0, "balanced", "block_grid 4x1 is larger than the token grid 3x3"),
    ((0, 3), (1, 1), 0, "balanced", "must be positive"),
    ((3, 3), (1, 1), -1, "balanced", "num_prefix_tokens"),
    ((3, 3), (1, 1), 0, "even", "unknown block mode"),
])
def test_bad_layouts(grid, block_grid, prefix, mode, match):
    with pytest.raises(ValueError, match=match):
        block_layout(grid, block_grid, mode, prefix)


@pytest.mark.parametrize("grid,block_grid,num_prefix_tokens,regular", [
    ((16, 16), (4, 4), 0, True), ((8, 12), (2, 3), 0, True), ((14, 14), (4, 4), 0, False), ((8, 8), (2, 2), 1, False),
])
def test_regular_layouts_reshape_to_the_same_order_as_the_gather(grid, block_grid, num_prefix_tokens, regular):
    layout = block_layout(grid, block_grid, num_prefix_tokens=num_prefix_tokens)
    assert layout.is_regular is regular
    n = num_prefix_tokens + grid[0] * grid[1]
    x = torch.randn(2, n, 3, 5).transpose(1, 2)  # [B, H, N, D], strided like split heads
    gathered = x.index_select(2, layout.index).unflatten(2, (layout.num_blocks + layout.num_prefix_blocks, -1))
    blocks = layout.to_blocks(x)
    assert torch.equal(blocks, gathered)
    assert torch.equal(layout.from_blocks(blocks.permute(0, 2, 3, 1, 4), dim=1), x.transpose(1, 2))
    out = torch.zeros(2, n, 4, 5)[:, :, 1:]  # [B, N, H, D] with the strides of a larger tensor
    assert layout.from_blocks(blocks.permute(0, 2, 3, 1, 4), dim=1, out=out) is out
    assert torch.equal(out, x.transpose(1, 2))


def test_one_cache_of_layouts_per_arguments_and_device():
    cpu = block_layout((6, 6), (2, 2))
    assert block_layout([6, 6], [2, 2], "balanced", 0, "cpu") is cpu
    meta = block_layout((6, 6), (2, 2), device=torch.device("meta"))
    assert meta is not cpu and block_layout((6, 6), (2, 2), device="meta") is meta
    assert meta.index.device.type == "meta" and meta.block_ids.shape == cpu.block_ids.shape
    assert MultiHeadLinearAttention(24, 2, grid_size=(6, 6), block_grid=(2, 2)).layout((6, 6)) is cpu
