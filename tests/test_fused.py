"""mhla.fused.qkv_attention: the naive reference's values and gradients, from the qkv output alone."""
import pytest
import torch
from helpers import rel_rms

from mhla.benchmark import saved_bytes
from mhla.blocks import block_layout
from mhla.fused import _chunks, _Plan, qkv_attention
from mhla.naive import naive_qkv_attention

C, H = 24, 3


def inputs(num_tokens: int, blocks: int | None, qk_norm: bool, dtype=torch.float64):
    """qkv ``[2, N, 3C]``, the two RMSNorm weights (or None) and W ``[blocks, blocks]`` in [0, 1] (or None)."""
    qkv = torch.randn(2, num_tokens, 3 * C, dtype=dtype, requires_grad=True)
    weights = [(1 + 0.3 * torch.randn(C, dtype=dtype)).requires_grad_() for _ in range(2)] if qk_norm else [None, None]
    mixing = None if blocks is None else torch.rand(blocks, blocks, dtype=dtype, requires_grad=True)
    return qkv, weights, mixing


def check(fused_fn, naive_fn, tensors, tol=1e-11):
    """Outputs and the gradients of every tensor in ``tensors`` agree."""
    out, expected = fused_fn(), naive_fn()
    assert rel_rms(out, expected) < tol
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, tensors, grad_out)
    want = torch.autograd.grad(expected, tensors, grad_out)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel_rms(g, w) < tol, f"gradient {i}"


@pytest.mark.parametrize("qk_norm,norm_eps,feature_eps", [(True, 1e-6, 1e-6), (True, None, 0.0), (False, 1e-6, 1e-3)])
@pytest.mark.parametrize("num_prefix_tokens", [0, 2])
def test_linear_attention_from_qkv(qk_norm, norm_eps, feature_eps, num_prefix_tokens):
    qkv, (wq, wk), _ = inputs(num_prefix_tokens + 30, None, qk_norm)
    opts = dict(q_weight=wq, k_weight=wk, norm_eps=norm_eps, feature_eps=feature_eps, eps=1e-5)
    check(lambda: qkv_attention(qkv, H, **opts), lambda: naive_qkv_attention(qkv, H, **opts),
          [qkv] + ([wq, wk] if qk_norm else []))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("grid,block_grid,num_prefix_tokens", [
    ((6, 6), (2, 3), 0),   # evenly divided: block-major order is a reshape
    ((7, 9), (2, 3), 0),   # unequal blocks: masked slots
    ((6, 6), (3, 3), 5),   # prefix tokens in a block of their own
    ((5, 7), (2, 2), 1),
])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_mhla_from_qkv(grid, block_grid, num_prefix_tokens, parallel, qk_norm):
    layout = block_layout(grid, block_grid, num_prefix_tokens=num_prefix_tokens)
    blocks = layout.num_blocks + layout.num_prefix_blocks
    qkv, (wq, wk), mixing = inputs(layout.num_tokens, blocks, qk_norm)
    opts = dict(q_weight=wq, k_weight=wk, norm_eps=1e-6, feature_eps=1e-6, eps=1e-6, mixing=mixing)
    check(lambda: qkv_attention(qkv, H, layout=layout, parallel=parallel, **opts),
          lambda: naive_qkv_attention(qkv, H, block_ids=layout.block_ids, **opts),
          [qkv, mixing] + ([wq, wk] if qk_norm else []))


@pytest.mark.parametrize("mhla,parallel,num_prefix_tokens,bias", [
    (False, False, 0, True),
    (False, False, 2, False),
    (True, False, 1, True),   # unequal blocks and a prefix block
    (True, True, 1, True),
])
def test_lepe_from_qkv(mhla, parallel, num_prefix_tokens, bias):
    grid = (5, 7)
    layout = block_layout(grid, (2, 2), num_prefix_tokens=num_prefix_tokens) if mhla else None
    blocks = layout.num_blocks + layout.num_prefix_blocks if mhla else None
    qkv, (wq, wk), mixing = inputs(num_prefix_tokens + 35, blocks, True)
    weight = torch.randn(C, 1, 3, 3, dtype=qkv.dtype, requires_grad=True)
    lepe_bias = torch.randn(C, dtype=qkv.dtype, requires_grad=True) if bias else None
    opts = dict(q_weight=wq, k_weight=wk, mixing=mixing, lepe_weight=weight, lepe_bias=lepe_bias)
    fused = dict(layout=layout, parallel=parallel) if mhla else dict(grid_size=grid)
    check(lambda: qkv_attention(qkv, H, **fused, **opts),
          lambda: naive_qkv_attention(qkv, H, block_ids=layout.block_ids if mhla else None, grid_size=grid, **opts),
          [qkv, wq, wk, weight] + ([mixing] if mhla else []) + ([lepe_bias] if bias else []))


def test_relu_at_zero_has_the_gradient_autograd_gives():
    qkv, _, _ = inputs(16, None, False)
    with torch.no_grad():
        qkv[:, :4] = 0.0  # ReLU'(0) = 0, as torch's
    check(lambda: qkv_attention(qkv, H, feature_eps=0.5), lambda: naive_qkv_attention(qkv, H, feature_eps=0.5), [qkv])


def test_only_the_qkv_tensor_is_kept_for_backward():
    layout = block_layout((7, 9), (2, 3))
    qkv, (wq, wk), mixing = inputs(63, 6, True, dtype=torch.float32)
    x = torch.randn(2, 63, C)
    proj = torch.nn.Linear(C, 3 * C)

    lepe = torch.nn.Conv2d(C, C, 3, groups=C)

    def forward():
        return qkv_attention(proj(x), H, q_weight=wq, k_weight=wk, mixing=mixing, layout=layout,
                             lepe_weight=lepe.weight, lepe_bias=lepe.bias)

    kept = saved_bytes(forward, exclude=[wq, wk, mixing, *proj.parameters(), *lepe.parameters()])
    assert kept == x.nbytes + 2 * 63 * 3 * C * 4  # the projection's input (kept by nn.Linear) and qkv


def test_autocast_runs_inside_in_fp32_and_returns_the_input_dtype():
    layout = block_layout((6, 6), (2, 2))
    qkv, (wq, wk), mixing = inputs(36, 4, True, dtype=torch.float32)
    lepe = torch.nn.Conv2d(C, C, 3, groups=C)
    opts = dict(q_weight=wq, k_weight=wk, mixing=mixing, layout=layout, lepe_weight=lepe.weight, lepe_bias=lepe.bias)
    low = qkv.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = qkv_attention(low, H, **opts)
    assert out.dtype == torch.bfloat16
    expected = qkv_attention(low.float(), H, **opts)
    assert rel_rms(out.float(), expected) < 1e-2
    out.float().sum().backward()
    assert low.grad.dtype == torch.bfloat16 and wq.grad.dtype == torch.float32 and mixing.grad.dtype == torch.float32
    assert lepe.weight.grad.dtype == torch.float32 and lepe.bias.grad.dtype == torch.float32


@pytest.mark.parametrize("kwargs,shape,match", [
    (dict(), (2, 10, 25), r"qkv must be \[B, N, 3C\] with C divisible by num_heads=3"),
    (dict(q_weight=torch.ones(C)), (2, 10, 3 * C), "q_weight and k_weight go together"),
    (dict(mixing=torch.ones(4, 4)), (2, 36, 3 * C), "MHLA needs both mixing and layout"),
    (dict(parallel=True), (2, 36, 3 * C), "parallel=True is a form of MHLA"),
    (dict(mixing=torch.ones(5, 5), layout=block_layout((6, 6), (2, 2))), (2, 36, 3 * C),
     r"mixing must be \[M \+ G, M \+ G\] = \[4, 4\]"),
    (dict(lepe_weight=torch.ones(C, 1, 4, 4), grid_size=(6, 6)), (2, 36, 3 * C),
     r"lepe_weight must be \[C, 1, k, k\] with C=24 and k odd, got \(24, 1, 4, 4\)"),
    (dict(lepe_weight=torch.ones(C, 1, 3, 3), lepe_bias=torch.ones(3), grid_size=(6, 6)), (2, 36, 3 * C),
     r"lepe_bias must be \[C\] = \[24\]"),
    (dict(lepe_weight=torch.ones(C, 1, 3, 3)), (2, 36, 3 * C), r"LePE needs the patch grid: grid_size=None for N=36"),
    (dict(lepe_weight=torch.ones(C, 1, 3, 3), grid_size=(6, 7)), (2, 36, 3 * C), r"grid_size=\(6, 7\) for N=36"),
    (dict(mixing=torch.ones(4, 4), layout=block_layout((6, 6), (2, 2))), (2, 35, 3 * C), "layout is for 36 tokens"),
])
def test_bad_inputs_are_named(kwargs, shape, match):
    with pytest.raises(ValueError, match=match):
        qkv_attention(torch.randn(shape), H, **kwargs)


def test_backward_chunks_cover_the_batch_and_are_cache_sized_on_cpu_only():
    plan = _Plan(3, block_layout((14, 14), (4, 4), num_prefix_tokens=1), True, (14, 14))
    cpu, gpu = (_chunks(plan, 128, 197, 192, cpu=device_is_cpu) for device_is_cpu in (True, False))
    for chunks in (cpu, gpu):
        assert torch.cat([torch.arange(128)[part] for part in chunks]).equal(torch.arange(128))
    assert len(cpu) == 64  # 2 images: 2 x 3 x 197^2 floats <= 2^18
    assert len(gpu) == 4  # 41 images: 41 x 3 x 197^2 floats ~ one [B, N, C] tensor; a GPU is slow in small pieces
