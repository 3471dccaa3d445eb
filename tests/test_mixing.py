"""Mixing-matrix initialisation and the [0, 1] constraint."""
import math

import pytest
import torch

from mhla import MixingMatrix, mhla_attention, mixing_init
from mhla.mixing import TRANSFORMS, block_distances


def test_block_distances():
    dist = block_distances((2, 3))
    assert dist.shape == (6, 6)
    assert dist[0, 0] == 0 and dist[0, 1] == 1 and dist[0, 3] == 1
    assert dist[0, 5] == pytest.approx(math.sqrt(5))


def test_transform_values_before_normalisation():
    dist = block_distances((4, 4))
    dmax = dist.max()
    linear = mixing_init((4, 4), "linear", "none")
    assert torch.allclose(linear, 1 - dist / dmax)
    assert linear[0, 15] == 0 and linear[0, 0] == 1
    assert torch.allclose(mixing_init((4, 4), "cos", "none"), torch.cos(dist / dmax * math.pi / 4))
    assert torch.allclose(mixing_init((4, 4), "exp", "none", sigma=2.0), torch.exp(-dist / 2))
    assert torch.allclose(mixing_init((4, 4), "gaussian", "none"), torch.exp(-dist ** 2 / (2 * (dmax / 3) ** 2)))
    local = mixing_init((3, 3), "local", "none")
    assert local[4].sum() == 9 and local[0].sum() == 4
    assert (mixing_init((2, 2), "uniform", "none") == 1).all()


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalisation_and_range(transform):
    rows = mixing_init((4, 4), transform, "rows")
    torch.testing.assert_close(rows.sum(1), torch.ones(16, dtype=torch.float64))
    columns = mixing_init((4, 4), transform, "columns")
    torch.testing.assert_close(columns.sum(0), torch.ones(16, dtype=torch.float64))
    for w in (rows, columns, mixing_init((4, 4), transform, "none")):
        assert w.min() >= 0 and w.max() <= 1


def test_single_block_is_one():
    for transform in TRANSFORMS:
        assert mixing_init((1, 1), transform).tolist() == [[1.0]]


def test_bad_options():
    with pytest.raises(ValueError, match="unknown mixing transform 'sine'"):
        mixing_init((2, 2), "sine")
    with pytest.raises(ValueError, match="unknown mixing normalization"):
        mixing_init((2, 2), "linear", "diagonal")


def test_projection_after_each_update_keeps_w_in_range():
    mixing = MixingMatrix((2, 2))
    opt = torch.optim.SGD(mixing.parameters(), lr=10.0)
    for sign in (1.0, -1.0):
        opt.zero_grad()
        (sign * mixing().sum()).backward()
        opt.step()
        assert mixing.weight.min() < 0 or mixing.weight.max() > 1  # the raw step left [0, 1] ...
        w = mixing()
        assert w.min() >= 0 and w.max() <= 1  # ... and the next use projects it back
    # several uses between two updates project once: both graphs stay valid
    (mixing().sum() + mixing().sum()).backward()


def test_projection_after_loading_a_state_dict():
    mixing = MixingMatrix((2, 2))
    mixing.load_state_dict({"weight": torch.full((4, 4), -0.5)})
    assert (mixing() == 0).all()


def test_frozen_and_unconstrained():
    frozen = MixingMatrix((2, 2), learnable=False)
    assert not frozen.weight.requires_grad
    assert torch.allclose(frozen(), mixing_init((2, 2)).float())
    free = MixingMatrix((2, 2), constrain=False)
    with torch.no_grad():
        free.weight.fill_(-1)
    assert (free() == -1).all()


def _fit_outside_convex_hull(constrain: bool, steps: int = 300):
    """Fit MHLA outputs to targets outside the hull of the values, the pull that drives W negative.

    Two blocks hold values +1 and -1; the target is 3x the values, reachable only with negative
    weights. Returns (smallest W ever used, smallest denominator relative to the first, final loss).
    """
    mixing = MixingMatrix((1, 2), "uniform", constrain=constrain)
    q, k = torch.rand(1, 1, 2, 16, 4), torch.rand(1, 1, 2, 16, 4)
    v = torch.tensor([1.0, -1.0]).view(1, 1, 2, 1, 1).expand(1, 1, 2, 16, 1)
    opt = torch.optim.SGD(mixing.parameters(), lr=0.5)
    z = k.sum(-2)[0, 0]  # [M, D]
    w_min, den_ratio, first = math.inf, math.inf, None
    for _ in range(steps):
        w = mixing()
        den = (q @ (w @ z).unsqueeze(-1)).min().item()  # smallest q_t . sum_j W_ij z_j
        first = den if first is None else first
        w_min, den_ratio = min(w_min, w.min().item()), min(den_ratio, den / first)
        loss = ((mhla_attention(q, k, v, w) - 3 * v) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w_min, den_ratio, loss.item()


def test_unconstrained_w_goes_negative_and_the_denominator_reaches_zero():
    w_min, den_ratio, _ = _fit_outside_convex_hull(constrain=False)
    assert w_min < 0
    assert den_ratio < 0.05  # the denominator came to (or crossed) zero
    w_min, den_ratio, loss = _fit_outside_convex_hull(constrain=True)
    assert w_min >= 0
    assert den_ratio > 0.5
    assert math.isfinite(loss)
