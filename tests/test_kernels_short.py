"""mhla.kernels.short: the parallel form's Triton kernels against the naive reference, values and gradients."""
import pytest
import torch

triton = pytest.importorskip("triton")

from helpers import rel_rms  # noqa: E402

from mhla.blocks import block_layout  # noqa: E402
from mhla.kernels import short  # noqa: E402
from mhla.kernels.short import short_attention  # noqa: E402
from mhla.naive import naive_qkv_attention  # noqa: E402

B, H, D = 2, 2, 32  # tl.arange and tl.dot: D a power of two, at least 16
C = H * D

# (grid, block grid, prefix tokens, W: "random" | "identity" | "uniform" | None, q/k norm), tile length or None,
# epsilons: large ones where the last tile is partly empty, so that a wrong eps or a padding row counted shows
EPS = dict(norm_eps=1e-3, feature_eps=0.1, eps=0.5)
CASES = {
    "uneven-prefix-random-norm": (((7, 9), (3, 2), 1, "random", True), None, {}),  # N = 64, one tile
    "uneven-prefix-identity-plain": (((7, 9), (3, 2), 1, "identity", False), None, {}),
    "uneven-prefix-random-tiles16": (((7, 9), (3, 2), 1, "random", True), 16, {}),  # 4 x 4 tiles
    "even-prefix-uniform-norm-eps": (((8, 8), (2, 2), 1, "uniform", True), None, EPS),  # N = 65: 1 token in a tile
    "linear-norm-eps": (((7, 9), None, 0, None, True), None, EPS),  # M = 1, N = 63
    "linear-plain": (((7, 9), None, 0, None, False), None, {}),
}


def _inputs(grid, block_grid, prefix, kind, norm):
    """qkv, q/k weights (or None), W (or None) and the layout (or None); W uniform is left without a gradient."""
    layout = None if block_grid is None else block_layout(grid, block_grid, "balanced", num_prefix_tokens=prefix)
    num_tokens = prefix + grid[0] * grid[1]
    qkv = torch.randn(B, num_tokens, 3 * C, requires_grad=True)
    weights = [(torch.rand(C) * 2 - 0.5).requires_grad_() for _ in range(2)] if norm else [None, None]  # some < 0
    mixing = None
    if layout is not None:
        blocks = layout.num_blocks + layout.num_prefix_blocks
        mixing = {"random": torch.rand(blocks, blocks), "identity": torch.eye(blocks),
                  "uniform": torch.ones(blocks, blocks)}[kind].requires_grad_(kind != "uniform")
    return qkv, *weights, mixing, layout


def _run(fn, qkv, q_weight, k_weight, mixing, grad_out, **kwargs):
    """The output and the gradients of the inputs that take one."""
    out = fn(qkv, H, q_weight=q_weight, k_weight=k_weight, mixing=mixing, **kwargs)
    inputs = [t for t in (qkv, q_weight, k_weight, mixing) if t is not None and t.requires_grad]
    return out, torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_values_and_gradients_are_the_naive_references(case, monkeypatch):
    shape, tile, options = case
    if tile is not None:
        monkeypatch.setattr(short, "_block_size", lambda num_tokens: tile)
    qkv, q_weight, k_weight, mixing, layout = _inputs(*shape)
    grad_out = torch.randn(qkv.shape[0], qkv.shape[1], C)
    out, grads = _run(short_attention, qkv, q_weight, k_weight, mixing, grad_out, layout=layout, **options)
    assert out.dtype == qkv.dtype and out.shape == grad_out.shape

    as_double = [None if t is None else t.detach().double().requires_grad_(t.requires_grad)
                 for t in (qkv, q_weight, k_weight, mixing)]
    expected, expected_grads = _run(naive_qkv_attention, *as_double, grad_out.double(),
                                    block_ids=None if layout is None else layout.block_ids, **options)
    assert rel_rms(out, expected) <= 1e-5
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert rel_rms(grad, expected_grad) <= 1e-5


def test_two_runs_give_bitwise_the_same_values_and_gradients():
    qkv, q_weight, k_weight, mixing, layout = _inputs((8, 8), (2, 2), 1, "random", True)
    grad_out = torch.randn(qkv.shape[0], qkv.shape[1], C)
    first, second = (_run(short_attention, qkv, q_weight, k_weight, mixing, grad_out, layout=layout)
                     for _ in range(2))
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1], strict=True))


LAYOUT = block_layout((7, 9), (3, 2), "balanced", num_prefix_tokens=1)  # N = 64, M + G = 7
BAD = {
    "qkv-shape": (dict(qkv=torch.zeros(1, 64, 100)), "qkv must be [B, N, 3C]"),
    "one-weight": (dict(q_weight=torch.ones(C)), "q_weight and k_weight go together"),
    "mixing-without-layout": (dict(mixing=torch.ones(7, 7)), "MHLA needs both mixing and layout"),
    "mixing-shape": (dict(mixing=torch.ones(6, 6), layout=LAYOUT), "mixing must be [M + G, M + G] = [7, 7]"),
    "layout-tokens": (dict(qkv=torch.zeros(1, 65, 3 * C), mixing=torch.ones(7, 7), layout=LAYOUT),
                      "layout is for 64 tokens, qkv has N=65"),
    "head-dim": (dict(qkv=torch.zeros(1, 64, 3 * 2 * 24)),
                 "the head dim must be a power of two from 16 to 128, got C / H = 24"),
}


@pytest.mark.parametrize("kwargs, message", BAD.values(), ids=BAD.keys())
def test_a_bad_argument_gives_a_one_line_error(kwargs, message):
    kwargs = dict(kwargs)
    qkv = kwargs.pop("qkv", torch.zeros(1, 64, 3 * C))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("+", r"\+")) as error:
        short_attention(qkv, H, **kwargs)
    assert "\n" not in str(error.value)
