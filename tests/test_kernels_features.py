"""mhla.kernels.features: the feature map on load and RMSNorm's backward across the heads, against the torch path."""
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from mhla.fused import feature_map  # noqa: E402
from mhla.kernels.features import features, features_backward, norm_backward, norm_statistics  # noqa: E402

B, N, H, D = 2, 8, 2, 4  # tl.arange takes powers of two


@triton.jit
def _features_kernel(qkv, rstd, weight, out, grad, grad_pre, feature_eps, N: tl.constexpr, C: tl.constexpr,
                     D: tl.constexpr, PART: tl.constexpr, NORM: tl.constexpr):
    """One program per (batch, head): the [N, D] tile of q (PART 0) or k (PART 1), mapped and differentiated."""
    b, h = tl.program_id(0), tl.program_id(1)
    rows, cols = tl.arange(0, N), tl.arange(0, D)
    x = tl.load(qkv + (b * N + rows[:, None]) * 3 * C + PART * C + h * D + cols[None, :])
    r = tl.load(rstd + (b * N + rows) * 2 + PART)
    w = tl.load(weight + PART * C + h * D + cols)
    at = (b * N + rows[:, None]) * C + h * D + cols[None, :]
    tl.store(out + at, features(x, r, w, feature_eps, NORM))
    tl.store(grad_pre + at, features_backward(tl.load(grad + at), x, r, w, NORM))


def _run(qkv, weight, part, norm):
    rstd = norm_statistics(qkv, 1e-6)
    out, grad = torch.empty(B, N, H * D), torch.randn(B, N, H * D)
    grad_pre = torch.empty_like(out)
    _features_kernel[(B, H)](qkv, rstd, weight, out, grad, grad_pre, 1e-6, N=N, C=H * D, D=D, PART=part, NORM=norm)
    return out, grad, grad_pre, rstd


@pytest.fixture
def qkv():
    return torch.randn(B, N, 3 * H * D)


@pytest.mark.parametrize("norm", [True, False], ids=["rmsnorm", "plain"])
@pytest.mark.parametrize("part", [0, 1], ids=["q", "k"])
def test_features_on_load_are_the_torch_feature_map(qkv, part, norm):
    weight = torch.rand(2, H * D) + 0.5
    out, _, _, _ = _run(qkv, weight, part, norm)
    x = qkv.unflatten(-1, (3, -1))[:, :, part]
    expected = feature_map(x, weight[part] if norm else None, 1e-6, 1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)


def test_the_pre_activation_gradient_and_the_norm_backward_are_autograd_s(qkv):
    """features_backward per head, then norm_backward across the heads: the gradients of x and w of ReLU(RMSNorm)."""
    weight = torch.rand(2, H * D) - 0.3  # some weights negative: the ReLU mask depends on the sign of x r w
    grads, grads_pre = [], []
    for part in (0, 1):
        _, grad, grad_pre, rstd = _run(qkv, weight, part, True)
        grads.append(grad)
        grads_pre.append(grad_pre)
    grad_v = torch.randn(B, N, H * D)
    grad = torch.stack([*grads_pre, grad_v], dim=2)  # [B, N, 3, C], as the kernels' gradient buffer
    grad_weight = norm_backward(grad, qkv, rstd, weight)
    assert torch.equal(grad[:, :, 2], grad_v)  # v's slot left as it is
    grad_qk = grad[:, :, :2]

    x = qkv.unflatten(-1, (3, -1))[:, :, :2].double().requires_grad_()
    w = weight.double().requires_grad_()
    phi = torch.relu(torch.nn.functional.rms_norm(x, (H * D,), eps=1e-6) * w) + 1e-6
    phi.backward(torch.stack(grads, dim=2).double())
    torch.testing.assert_close(grad_qk.double(), x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight.double(), w.grad, rtol=1e-5, atol=1e-6)
