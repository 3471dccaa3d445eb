import pytest
import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-6) -> float:
    """Relative error, fla-style: ``||a - e|| / max(||e||, floor)`` in float64.

    The floor keeps quantities that are zero in exact arithmetic (the gradient of W when M = 1,
    which scales numerator and denominator alike) from turning rounding into a large ratio.
    """
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(floor)).item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
