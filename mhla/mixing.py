"""The M x M mixing matrix W: distance-based initialisation and the [0, 1] constraint.

Row i of W says how much query block i reads of each key block's summary. W is initialised from
the distances between block centres and then learned. It must stay non-negative: the denominator
``q_t . sum_j W_ij z_j`` of MHLA is a sum of non-negative terms only while W >= 0; a negative
entry lets it reach zero and the output blow up (``tests/test_mixing.py`` trains an unconstrained
W into exactly that). The paper clips W to [0, 1] after every update; ``MixingMatrix`` does the
same projection itself, so that no training loop has to know about it.
"""
import math

import torch
from torch import nn

__all__ = ["NORMALIZATIONS", "TRANSFORMS", "MixingMatrix", "block_distances", "mixing_init"]

TRANSFORMS = ("linear", "cos", "exp", "gaussian", "local", "uniform")
NORMALIZATIONS = ("rows", "columns", "none")


def block_distances(block_grid: tuple[int, int]) -> torch.Tensor:
    """Distances ``[M, M]`` (float64, CPU) between the centres ``(r + 0.5, c + 0.5)`` of a row-major block grid."""
    bh, bw = block_grid
    rows, cols = torch.meshgrid(torch.arange(bh, device="cpu"), torch.arange(bw, device="cpu"), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=-1).double() + 0.5  # [M, 2]
    return torch.cdist(centres, centres)


def mixing_init(
        block_grid: tuple[int, int],
        transform: str = "linear",
        normalize: str = "rows",
        sigma: float | None = None,
        threshold: float = 1.5,
) -> torch.Tensor:
    """Initial mixing matrix ``[M, M]`` (float64, CPU) from block-centre distances D.

    Args:
        block_grid: ``(bh, bw)``, M = bh * bw.
        transform: ``linear`` 1 - D/Dmax, ``cos`` cos(D/Dmax * pi/4), ``exp`` exp(-D/sigma)
            (sigma defaults to 3), ``gaussian`` exp(-D^2 / (2 sigma^2)) (sigma defaults to Dmax/3),
            ``local`` 1[D <= threshold] (self + 8 neighbours at 1.5), ``uniform`` 1.
        normalize: ``rows`` (paper: each query block's weights sum to 1), ``columns`` (released
            code), or ``none``. The released code leaves ``gaussian`` unnormalised.
        sigma: scale of ``exp`` and ``gaussian``.
        threshold: radius of ``local``, in block units.
    """
    if transform not in TRANSFORMS:
        raise ValueError(f"unknown mixing transform {transform!r}; expected one of {TRANSFORMS}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"unknown mixing normalization {normalize!r}; expected one of {NORMALIZATIONS}")
    dist = block_distances(block_grid)
    dmax = dist.max()
    relative = dist / dmax if dmax > 0 else torch.zeros_like(dist)
    if transform == "linear":
        w = 1.0 - relative
    elif transform == "cos":
        w = torch.cos(relative * math.pi / 4)
    elif transform == "exp":
        w = torch.exp(-dist / (3.0 if sigma is None else sigma))
    elif transform == "gaussian":
        s = (dmax / 3 if dmax > 0 else 1.0) if sigma is None else sigma
        w = torch.exp(-dist ** 2 / (2 * s ** 2))
    elif transform == "local":
        w = (dist <= threshold).double()
    else:
        w = torch.ones_like(dist)
    if normalize == "rows":
        w = w / w.sum(dim=1, keepdim=True)
    elif normalize == "columns":
        w = w / w.sum(dim=0, keepdim=True)
    return w


class MixingMatrix(nn.Module):
    """Learnable mixing matrix kept in [0, 1].

    ``forward()`` returns W ``[M, M]``. With ``constrain=True`` it first projects the parameter onto
    [0, 1] in place (a no-op unless an optimizer step, EMA update or state-dict load moved it out):
    the paper's "clip on every update", owned by the module, so no training loop has to do it. The
    gradient is taken at the projected point, as in projected gradient descent. W is returned as a
    copy, so a later projection never invalidates a graph that still needs the W it used.

    Args:
        block_grid: ``(bh, bw)``.
        transform, normalize, sigma, threshold: see ``mixing_init``.
        learnable: False freezes W at its initial value.
        constrain: False lets W leave [0, 1] (for ablations; training can diverge).
    """

    def __init__(
            self,
            block_grid: tuple[int, int],
            transform: str = "linear",
            normalize: str = "rows",
            sigma: float | None = None,
            threshold: float = 1.5,
            learnable: bool = True,
            constrain: bool = True,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        init = mixing_init(block_grid, transform, normalize, sigma, threshold)
        self.block_grid = tuple(block_grid)
        self.constrain = constrain
        device = torch.get_default_device() if device is None else device  # e.g. inside `with torch.device("meta")`
        self.weight = nn.Parameter(init.to(device=device, dtype=dtype or torch.get_default_dtype()),
                                   requires_grad=learnable)

    def forward(self) -> torch.Tensor:
        if not self.constrain:
            return self.weight
        with torch.no_grad():
            self.weight.clamp_(0.0, 1.0)
        return self.weight.clone()

    def extra_repr(self) -> str:
        return f"block_grid={self.block_grid}, constrain={self.constrain}, learnable={self.weight.requires_grad}"
