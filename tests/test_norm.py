"""mhla.norm.RMSNorm: torch's RMSNorm in values and gradients, timm's RmsNorm in state dict, only its input kept."""
import pytest
import torch
import torch.nn.functional as F
from helpers import rel_rms
from timm.layers import RmsNorm

from mhla import RMSNorm
from mhla.benchmark import saved_bytes


@pytest.mark.parametrize("affine,eps", [(True, 1e-6), (False, 1e-6), (True, None)])
def test_values_and_gradients_are_torchs(affine, eps):
    norm = RMSNorm(12, eps=eps, affine=affine).double()
    if affine:
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.3)
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    out, expected = norm(x), F.rms_norm(x, (12,), norm.weight, eps)
    assert rel_rms(out, expected) < 1e-13
    grad_out = torch.randn_like(out)
    tensors = [x, norm.weight] if affine else [x]
    for got, want in zip(torch.autograd.grad(out, tensors, grad_out), torch.autograd.grad(expected, tensors, grad_out),
                         strict=True):
        assert rel_rms(got, want) < 1e-12


def test_timms_state_dict_loads_and_gives_the_same_output():
    timm_norm, norm = RmsNorm(16), RMSNorm(16)
    with torch.no_grad():
        timm_norm.weight.uniform_(0.5, 1.5)
    norm.load_state_dict(timm_norm.state_dict())
    x = torch.randn(4, 16)
    torch.testing.assert_close(norm(x), timm_norm(x))


def test_only_the_input_is_kept_and_bf16_autocast_works():
    norm = RMSNorm(64)
    x = torch.randn(8, 64, requires_grad=True)
    assert saved_bytes(lambda: norm(x * 2), exclude=[norm.weight]) == x.nbytes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(torch.nn.functional.linear(x, torch.eye(64)))
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all() and norm.weight.grad.dtype == torch.float32
