"""mhla.kernels.block: the block form's kernels against the naive N x N reference, values and gradients."""
import pytest
import torch

triton = pytest.importorskip("triton")

from helpers import rel_rms  # noqa: E402

from mhla.blocks import block_layout  # noqa: E402
from mhla.kernels.block import block_attention  # noqa: E402
from mhla.naive import naive_qkv_attention  # noqa: E402

B, H, D = 2, 2, 32
C = H * D
PARAMS = ("q_weight", "k_weight", "mixing")

# name: (token grid, block grid, prefix tokens); None is plain linear attention (M = 1, mixing None) of N = 50
# tokens. Blocks of T = 15 and 16 slots are one tile of BLOCK_T = 16, those of "tall" T = 36 three, the last partial.
LAYOUTS = {
    "uneven-prefix": ((7, 9), (3, 2), 1),
    "tall": ((7, 9), (2, 1), 1),
    "even": ((8, 8), (2, 2), 0),
    "linear": None,
}


def _inputs(layout_name: str, mixing: str, norm: bool):
    """qkv ``[B, N, 3C]`` and the keyword arguments of ``block_attention`` (norm weights, mixing, layout)."""
    spec = LAYOUTS[layout_name]
    layout = None if spec is None else block_layout(spec[0], spec[1], "balanced", num_prefix_tokens=spec[2])
    num_tokens = 50 if layout is None else layout.num_tokens
    kwargs = {}
    if norm:
        kwargs["q_weight"], kwargs["k_weight"] = 1 + 0.2 * torch.randn(2, C)
    if layout is not None:
        blocks = layout.num_blocks + layout.num_prefix_blocks
        kwargs["mixing"] = {"identity": torch.eye(blocks), "uniform": torch.full((blocks, blocks), 1 / blocks),
                            "random": torch.rand(blocks, blocks)}[mixing]
        kwargs["layout"] = layout
    return torch.randn(B, num_tokens, 3 * C), kwargs


def _differentiate(attention, qkv, kwargs, dtype, **extra):
    """``attention``'s output and the gradients of qkv and the parameters given (a fixed output gradient), in dtype."""
    names = [name for name in PARAMS if name in kwargs]
    leaves = [x.to(dtype, copy=True).requires_grad_() for x in [qkv] + [kwargs[name] for name in names]]
    out = attention(leaves[0], H, **{**kwargs, **dict(zip(names, leaves[1:], strict=True)), **extra})
    grad_out = torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(out.shape)
    return out, dict(zip(["qkv", *names], torch.autograd.grad(out, leaves, grad_out), strict=True))


def _kernel(qkv, kwargs):
    return _differentiate(block_attention, qkv, kwargs, torch.float32)


def _reference(qkv, kwargs):
    """The same from ``naive_qkv_attention`` in float64."""
    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", None)
    return _differentiate(naive_qkv_attention, qkv, kwargs, torch.float64,
                          block_ids=None if layout is None else layout.block_ids)


@pytest.mark.parametrize("layout_name, mixing, norm", [
    ("uneven-prefix", "random", True),
    ("uneven-prefix", "random", False),
    ("uneven-prefix", "identity", True),
    ("uneven-prefix", "uniform", False),
    ("tall", "random", True),
    ("even", "random", True),
    ("linear", None, True),
    ("linear", None, False),
], ids=["uneven-prefix-W-rmsnorm", "uneven-prefix-W", "uneven-prefix-identity-rmsnorm", "uneven-prefix-uniform",
        "tall-W-rmsnorm", "even-W-rmsnorm", "linear-rmsnorm", "linear"])
def test_values_and_gradients_are_the_naive_reference_s(layout_name, mixing, norm):
    qkv, kwargs = _inputs(layout_name, mixing, norm)
    out, grads = _kernel(qkv, kwargs)
    expected, expected_grads = _reference(qkv, kwargs)
    assert out.dtype == qkv.dtype and out.shape == (B, qkv.shape[1], C)
    assert rel_rms(out, expected) <= 1e-5
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        assert rel_rms(grad, expected_grads[name]) <= 1e-5, name


def test_two_runs_are_bitwise_identical():
    qkv, kwargs = _inputs("uneven-prefix", "random", True)
    (out, grads), (again, grads_again) = _kernel(qkv, kwargs), _kernel(qkv, kwargs)
    assert torch.equal(out, again)
    assert all(torch.equal(grad, grads_again[name]) for name, grad in grads.items())


@pytest.mark.parametrize("change, message", [
    (dict(qkv=torch.randn(B, 64, 3 * C + 1)), "qkv must be"),
    (dict(qkv=torch.randn(B, 64, 3 * C, dtype=torch.float64)), "float16, bfloat16 or float32"),
    (dict(qkv=torch.randn(B, 64, 3 * 2 * 24)), "power of two"),
    (dict(q_weight=torch.ones(C)), "go together"),
    (dict(mixing=torch.eye(4)), "needs both mixing and layout"),
    (dict(mixing=torch.eye(3), layout=block_layout((8, 8), (2, 2))), r"\[4, 4\]"),
    (dict(mixing=torch.eye(4), layout=block_layout((4, 4), (2, 2))), "layout is for 16 tokens"),
], ids=["shape", "dtype", "head-dim", "one-weight", "mixing-alone", "mixing-shape", "layout-tokens"])
def test_a_bad_argument_is_refused_in_one_line(change, message):
    kwargs = {"qkv": torch.randn(B, 64, 3 * C), **change}
    with pytest.raises(ValueError, match=message) as error:
        block_attention(kwargs.pop("qkv"), H, **kwargs)
    assert "\n" not in str(error.value)
