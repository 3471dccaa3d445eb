"""The fast ops against the naive N x N references, across awkward shapes, dtypes and gradients."""
import pytest
import torch
from helpers import rel_rms

from mhla import block_layout, linear_attention, mhla_attention, mhla_attention_parallel
from mhla.naive import mhla_attention_matrix, naive_linear_attention, naive_mhla_attention, naive_softmax_attention

GRIDS = [(14, 14), (7, 9), (16, 16)]
BLOCK_GRIDS = [(1, 1), (2, 3), (4, 4)]
DTYPES = [torch.float64, torch.bfloat16]
TOLERANCE = {torch.float64: 1e-12, torch.bfloat16: 2e-2}


def make_inputs(batch, heads, num_tokens, head_dim, dtype, value_dim=None):
    """Feature-mapped q, k (ReLU + eps of a Gaussian) and Gaussian v, ``[B, H, N, D]``, leaf tensors."""
    q = torch.randn(batch, heads, num_tokens, head_dim).relu() + 1e-6
    k = torch.randn(batch, heads, num_tokens, head_dim).relu() + 1e-6
    v = torch.randn(batch, heads, num_tokens, value_dim or head_dim)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def random_mixing(num_blocks, dtype):
    return torch.rand(num_blocks, num_blocks).to(dtype).requires_grad_()


def fast_mhla(layout, q, k, v, mixing, **kwargs):
    """The fast op from token order: partition, attend, gather back."""
    key_mask = None if layout.evenly_divided else layout.mask[None]
    out = mhla_attention(layout.to_blocks(q), layout.to_blocks(k), layout.to_blocks(v), mixing,
                         key_mask=key_mask, **kwargs)
    return layout.from_blocks(out)


def upcast(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def assert_matches(out, ref, inputs, reference_inputs, dtype):
    """Output and the gradients of q, k, v and W within the tolerance of ``dtype``."""
    assert out.dtype == dtype
    assert rel_rms(out, ref) < TOLERANCE[dtype]
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
    ref_grads = torch.autograd.grad(ref, reference_inputs, grad_out)
    # dL/dW sums products of O(1) terms that cancel exactly when M = 1 (W scales numerator and
    # denominator alike), so its error is measured against that O(1) scale
    for name, grad, ref_grad, floor in zip("qkvW", grads, ref_grads, (1e-6, 1e-6, 1e-6, 1.0), strict=True):
        assert rel_rms(grad, ref_grad, floor) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("head_dim", [60, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("block_grid", BLOCK_GRIDS, ids=lambda g: f"M{g[0]}x{g[1]}")
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"G{g[0]}x{g[1]}")
@pytest.mark.parametrize("batch", [1, 3], ids=lambda b: f"B{b}")
def test_mhla_matches_naive(batch, grid, block_grid, head_dim, dtype):
    layout = block_layout(grid, block_grid)
    inputs = make_inputs(batch, 2, grid[0] * grid[1], head_dim, dtype) + [random_mixing(layout.num_blocks, dtype)]
    reference_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    reference_inputs = upcast(inputs, reference_dtype)

    out = fast_mhla(layout, *inputs)
    ref = naive_mhla_attention(*reference_inputs[:4], layout.block_ids)
    assert_matches(out, ref, inputs, reference_inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("block_grid", BLOCK_GRIDS, ids=lambda g: f"M{g[0]}x{g[1]}")
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"G{g[0]}x{g[1]}")
def test_parallel_form_matches_naive(grid, block_grid, dtype):
    layout = block_layout(grid, block_grid)
    inputs = make_inputs(2, 2, grid[0] * grid[1], 60, dtype) + [random_mixing(layout.num_blocks, dtype)]
    reference_inputs = upcast(inputs, torch.float64 if dtype == torch.float64 else torch.float32)

    out = mhla_attention_parallel(*inputs, layout.block_ids)
    ref = naive_mhla_attention(*reference_inputs, layout.block_ids)
    assert_matches(out, ref, inputs, reference_inputs, dtype)


def test_parallel_form_with_frozen_mixing_and_value_width():
    layout = block_layout((6, 5), (2, 2))
    q, k, v = make_inputs(1, 2, 30, 8, torch.float64, value_dim=12)
    mixing = torch.rand(4, 4, dtype=torch.float64)
    out = mhla_attention_parallel(q, k, v, mixing, layout.block_ids)
    ref = naive_mhla_attention(q, k, v, mixing, layout.block_ids)
    assert out.shape == (1, 2, 30, 12)
    assert rel_rms(out, ref) < 1e-12
    with torch.no_grad():  # inference weights the scores in place
        assert torch.equal(mhla_attention_parallel(q, k, v, mixing, layout.block_ids), out)
    grad_out = torch.randn_like(out)
    for grad, ref_grad in zip(torch.autograd.grad(out, (q, k, v), grad_out),
                              torch.autograd.grad(ref, (q, k, v), grad_out), strict=True):
        assert rel_rms(grad, ref_grad) < 1e-12


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.rand(1, 2, 4, 4, 8)), "expected q, k"),
    (dict(mixing=torch.rand(3, 4)), "mixing must be \\[M, M\\]"),
    (dict(block_ids=torch.zeros(5, dtype=torch.long)), "block_ids must be \\[N\\] = \\[16\\]"),
])
def test_parallel_form_bad_arguments(bad, match):
    args = dict(q=torch.rand(1, 2, 16, 8), k=torch.rand(1, 2, 16, 8), v=torch.rand(1, 2, 16, 8),
                mixing=torch.rand(4, 4), block_ids=block_layout((4, 4), (2, 2)).block_ids)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        mhla_attention_parallel(**args)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(1, 1, 63, 60), (3, 2, 196, 64)], ids=lambda s: "B{}-H{}-N{}-D{}".format(*s))
def test_linear_matches_naive(shape, dtype):
    inputs = make_inputs(*shape, dtype)
    reference_inputs = upcast(inputs, torch.float64)
    out = linear_attention(*inputs)
    ref = naive_linear_attention(*reference_inputs)
    assert rel_rms(out, ref) < TOLERANCE[dtype]
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
    for grad, ref_grad in zip(grads, torch.autograd.grad(ref, reference_inputs, grad_out), strict=True):
        assert rel_rms(grad, ref_grad) < TOLERANCE[dtype]


@pytest.mark.parametrize("scale", [None, 0.3])
def test_naive_softmax_is_what_sdpa_computes(scale):
    """The softmax reference the analysis builds timm's attention matrices from, against PyTorch's SDPA."""
    q, k, v = (torch.randn(2, 3, 50, 16, dtype=torch.float64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    assert rel_rms(naive_softmax_attention(q, k, v, scale=scale), expected) < 1e-12


@pytest.mark.parametrize("grid,block_grid", [((16, 16), (4, 4)), ((7, 9), (7, 3)), ((6, 6), (1, 1))])
def test_official_normalizer_matches_naive(grid, block_grid):
    layout = block_layout(grid, block_grid)
    inputs = make_inputs(2, 2, grid[0] * grid[1], 16, torch.float64) + [random_mixing(layout.num_blocks, torch.float64)]
    out = fast_mhla(layout, *inputs, normalizer="official")
    ref = naive_mhla_attention(*inputs[:4], layout.block_ids, normalizer="official")
    assert rel_rms(out, ref) < 1e-12
    grad_out = torch.randn_like(ref)
    grads, ref_grads = torch.autograd.grad(out, inputs, grad_out), torch.autograd.grad(ref, inputs, grad_out)
    for grad, ref_grad, floor in zip(grads, ref_grads, (1e-6, 1e-6, 1e-6, 1.0), strict=True):
        assert rel_rms(grad, ref_grad, floor) < 1e-12


def test_official_normalizer_rows_do_not_sum_to_one():
    layout = block_layout((8, 8), (2, 2))
    q, k, _ = make_inputs(1, 1, 64, 8, torch.float64)
    mixing = torch.rand(4, 4, dtype=torch.float64)
    rows = mhla_attention_matrix(q, k, mixing, layout.block_ids, normalizer="official").sum(-1)
    assert (rows - 1).abs().max() > 0.05


def test_official_normalizer_rejects_uneven_blocks():
    layout = block_layout((14, 14), (4, 4))
    q, k, v = make_inputs(1, 1, 196, 8, torch.float32)
    with pytest.raises(ValueError, match="evenly divided"):
        mhla_attention(*(layout.to_blocks(t) for t in (q, k, v)), torch.rand(16, 16), key_mask=layout.mask[None],
                       normalizer="official")
    with pytest.raises(ValueError, match="equal size"):
        mhla_attention_matrix(q, k, torch.rand(16, 16), layout.block_ids, normalizer="official")


def test_one_block_is_linear_attention():
    q, k, v = make_inputs(2, 3, 49, 16, torch.float64)
    layout = block_layout((7, 7), (1, 1))
    out = fast_mhla(layout, q, k, v, torch.ones(1, 1, dtype=torch.float64))
    assert rel_rms(out, linear_attention(q, k, v)) < 1e-12
    assert rel_rms(out, naive_linear_attention(q, k, v)) < 1e-12


def test_identity_mixing_is_block_local_linear_attention():
    layout = block_layout((7, 9), (2, 3))
    q, k, v = make_inputs(2, 2, 63, 8, torch.float64)
    out = fast_mhla(layout, q, k, v, torch.eye(6, dtype=torch.float64))
    expected = torch.empty_like(out)
    for block in range(6):
        tokens = (layout.block_ids == block).nonzero().flatten()
        expected[:, :, tokens] = linear_attention(q[:, :, tokens], k[:, :, tokens], v[:, :, tokens])
    assert rel_rms(out, expected) < 1e-12


@pytest.mark.parametrize("grid,block_grid", [((14, 14), (4, 4)), ((7, 9), (2, 3))])
def test_rows_sum_to_one(grid, block_grid):
    layout = block_layout(grid, block_grid)
    q, k = (torch.rand(2, 2, grid[0] * grid[1], 8, dtype=torch.float64) for _ in range(2))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, dtype=torch.float64)
    rows = mhla_attention_matrix(q, k, mixing, layout.block_ids).sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-6)
    ones = torch.ones(2, 2, grid[0] * grid[1], 1, dtype=torch.float64)
    out = fast_mhla(layout, q, k, ones, mixing)
    torch.testing.assert_close(out, ones, rtol=0, atol=1e-6)


def test_padded_slots_change_nothing():
    layout = block_layout((14, 14), (4, 4))
    q, k, v = (layout.to_blocks(t.detach()) for t in make_inputs(2, 2, 196, 8, torch.float64))
    mixing = torch.rand(16, 16, dtype=torch.float64)
    key_mask = layout.mask[None]
    out = mhla_attention(q, k, v, mixing, key_mask=key_mask)
    garbage = ~layout.mask[None, None, :, :, None]
    noisy = [t.masked_fill(garbage, 1e3).requires_grad_() for t in (q, k, v)]
    noisy_out = mhla_attention(*noisy, mixing, key_mask=key_mask)
    real = layout.mask[None, None, :, :, None].expand_as(out)
    assert torch.equal(out[real], noisy_out[real]) or rel_rms(out[real], noisy_out[real]) < 1e-12
    grads = torch.autograd.grad(noisy_out[real].sum(), noisy)
    for grad in grads:
        assert grad.masked_select(garbage).abs().max() == 0


def test_fp16_autocast_long_sequence_is_finite_and_accurate():
    n = 16384
    q, k, v = (t.detach() for t in make_inputs(1, 2, n, 64, torch.float32))
    layout = block_layout((128, 128), (4, 4))
    qb, kb, vb = (layout.to_blocks(t) for t in (q, k, v))
    mixing = torch.rand(16, 16)
    reference = mhla_attention(qb, kb, vb, mixing)
    # the denominators are far beyond fp16's range: an fp16 accumulation would overflow
    z = kb.sum(-2)
    assert (qb[..., :1, :] @ (mixing @ z).unsqueeze(-1)).max() > torch.finfo(torch.float16).max
    with torch.autocast("cpu", dtype=torch.float16):
        out = mhla_attention(qb.half(), kb.half(), vb.half(), mixing)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert rel_rms(out, reference) < 1e-2
    lin = linear_attention(q.half(), k.half(), v.half())
    assert torch.isfinite(lin).all()
    assert rel_rms(lin, linear_attention(q, k, v)) < 1e-2


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.rand(1, 2, 4, 4)), "expected q, k"),
    (dict(mixing=torch.rand(3, 3)), "mixing must be"),
    (dict(normalizer="nope"), "unknown normalizer"),
    (dict(key_mask=torch.ones(1, 4, 5, dtype=torch.bool)), "key_mask must be"),
])
def test_bad_arguments(bad, match):
    args = dict(q=torch.rand(1, 2, 4, 4, 8), k=torch.rand(1, 2, 4, 4, 8), v=torch.rand(1, 2, 4, 4, 8),
                mixing=torch.rand(4, 4))
    args.update(bad)
    kwargs = {key: args.pop(key) for key in ("normalizer", "key_mask") if key in args}
    with pytest.raises(ValueError, match=match):
        mhla_attention(args["q"], args["k"], args["v"], args["mixing"], **kwargs)


@pytest.mark.parametrize("op", ["blocks", "parallel", "linear"])
def test_ops_run_on_the_meta_device(op):
    """Shapes and dtypes without data (timm builds models on ``meta`` to check them): no autocast to leave there."""
    q, k, v = (torch.empty(2, 3, 16, 8, device="meta", dtype=torch.bfloat16) for _ in range(3))
    mixing = torch.empty(4, 4, device="meta", dtype=torch.bfloat16)
    layout = block_layout((4, 4), (2, 2))
    if op == "blocks":
        out = layout.from_blocks(mhla_attention(layout.to_blocks(q), layout.to_blocks(k), layout.to_blocks(v), mixing))
    elif op == "parallel":
        out = mhla_attention_parallel(q, k, v, mixing, layout.block_ids.to("meta"))
    else:
        out = linear_attention(q, k, v)
    assert out.device.type == "meta" and out.shape == (2, 3, 16, 8) and out.dtype == torch.bfloat16


def test_autocast_is_left_only_where_it_is_on():
    """On the CPU under bf16 autocast the op computes in fp32: its output is the fp32 op's, rounded once."""
    q, k, v = (t.detach().bfloat16() for t in make_inputs(2, 3, 64, 16, torch.float32))
    mixing = torch.rand(4, 4)
    block_ids = block_layout((8, 8), (2, 2)).block_ids
    expected = mhla_attention_parallel(q.float(), k.float(), v.float(), mixing, block_ids).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mhla_attention_parallel(q, k, v, mixing, block_ids)
        scores = q.float() @ k.float().transpose(-1, -2)
    assert scores.dtype == torch.bfloat16  # autocast is on again after the op
    assert torch.equal(out, expected)
