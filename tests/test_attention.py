"""The attention modules: equal to the naive references, prefix-token semantics, timm drop-in, errors."""
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import rel_rms
from timm.models.vision_transformer import Block, VisionTransformer

from mhla import LinearAttention, MultiHeadLinearAttention
from mhla.naive import mhla_attention_matrix, naive_linear_attention, naive_mhla_attention


def features(module, x):
    """The module's q, k, v ``[B, H, N, D]`` for input x, and v in token order ``[B, N, C]``."""
    q, k, v = module.features(x)
    return q, k, v, v.transpose(1, 2).flatten(2)


def finish(module, out_heads, v, grid, norm=True):
    """LePE, the module's norm (``scale_norm``) and projection on top of the per-head attention output."""
    out = out_heads.transpose(1, 2).flatten(2)
    if module.lepe is not None:
        out = out + F.pad(module.lepe(v[:, module.num_prefix_tokens:], grid), (0, 0, module.num_prefix_tokens, 0))
    return module.proj(module.norm(out) if norm else out)


def naive_module_output(module, x, grid, norm=True):
    """The MHLA module's output rebuilt from the naive reference."""
    q, k, v_heads, v = features(module, x)
    layout = module.layout(grid)
    return finish(module, naive_mhla_attention(q, k, v_heads, module.full_mixing(layout), layout.block_ids), v, grid,
                  norm)


@pytest.mark.parametrize("form", ["blocks", "parallel"])
@pytest.mark.parametrize("grid,block_grid", [((7, 9), (2, 3)), ((14, 14), (4, 4)), ((4, 4), (4, 4))])
@pytest.mark.parametrize("num_prefix_tokens", [0, 1, 5])
@pytest.mark.parametrize("lepe_kernel", [0, 3])
def test_mhla_module_matches_naive(grid, block_grid, num_prefix_tokens, lepe_kernel, form):
    module = MultiHeadLinearAttention(48, 3, qk_norm=True, grid_size=grid, block_grid=block_grid,
                                      num_prefix_tokens=num_prefix_tokens, lepe_kernel=lepe_kernel,
                                      form=form).double()
    with torch.no_grad():
        module.mixing.weight.uniform_()
        module.q_norm.weight.normal_(1.0, 0.3)
    x = torch.randn(2, num_prefix_tokens + grid[0] * grid[1], 48, dtype=torch.float64, requires_grad=True)
    assert_same_values_and_gradients(module, x, naive_module_output(module, x, grid))


def assert_same_values_and_gradients(module, x, expected):
    """``module(x)`` equals ``expected`` (the naive reference), and so do the gradients of x and every parameter."""
    out = module(x)
    assert rel_rms(out, expected) < 1e-12
    grad_out = torch.randn_like(out)
    tensors = [x, *module.parameters()]
    names = ["x", *(name for name, _ in module.named_parameters())]
    for name, got, want in zip(names, torch.autograd.grad(out, tensors, grad_out),
                               torch.autograd.grad(expected, tensors, grad_out), strict=True):
        assert rel_rms(got, want) < 1e-10, name


@pytest.mark.parametrize("num_prefix_tokens", [0, 1])
def test_forms_agree_in_outputs_and_gradients(num_prefix_tokens):
    blocks, parallel = (MultiHeadLinearAttention(48, 3, qk_norm=True, grid_size=(7, 9), block_grid=(2, 3), form=form,
                                                 num_prefix_tokens=num_prefix_tokens).double()
                        for form in ("blocks", "parallel"))
    with torch.no_grad():
        blocks.mixing.weight.uniform_()
    parallel.load_state_dict(blocks.state_dict())
    x = torch.randn(2, num_prefix_tokens + 63, 48, dtype=torch.float64)
    grad_out = torch.randn(2, num_prefix_tokens + 63, 48, dtype=torch.float64)
    outs = [module(x) for module in (blocks, parallel)]
    assert rel_rms(outs[1], outs[0]) < 1e-12
    grads = [torch.autograd.grad(out, list(module.parameters()), grad_out)
             for out, module in zip(outs, (blocks, parallel), strict=True)]
    for (name, _), grad_blocks, grad_parallel in zip(blocks.named_parameters(), *grads, strict=True):
        assert rel_rms(grad_parallel, grad_blocks) < 1e-10, name


@pytest.mark.parametrize("grid,head_dim,expected", [
    ((14, 14), 64, True),    # 224 px: 196 tokens in 256 padded slots
    ((15, 15), 64, False),
    ((16, 16), 64, False),   # 256 px
    ((8, 8), 32, True),      # the quick start
    ((64, 64), 64, False),   # 1024 px
])
def test_auto_form_picks_parallel_for_short_sequences_only(grid, head_dim, expected):
    module = MultiHeadLinearAttention(3 * head_dim, 3, grid_size=grid)
    assert module.uses_parallel_form(module.layout(grid)) is expected


def test_auto_form_keeps_the_official_normalizer_in_blocks():
    official = MultiHeadLinearAttention(96, 3, grid_size=(8, 8), normalizer="official")
    assert not official.uses_parallel_form(official.layout((8, 8)))


def test_prefix_tokens_read_every_token_and_every_query_reads_them():
    module = MultiHeadLinearAttention(24, 2, grid_size=(6, 6), block_grid=(3, 3), num_prefix_tokens=2,
                                      lepe_kernel=0).double()
    x = torch.randn(1, 38, 24, dtype=torch.float64)
    q, k, v_heads, _ = features(module, x)
    layout = module.layout((6, 6))
    mixing = module.full_mixing(layout)
    attn = mhla_attention_matrix(q, k, mixing, layout.block_ids)  # [B, H, N, N]
    # prefix queries: plain linear attention over all tokens
    expected = naive_linear_attention(q, k, v_heads)[:, :, :2]
    assert rel_rms((attn @ v_heads)[:, :, :2], expected) < 1e-12
    # patch queries give the prefix keys weight 1 and every row still sums to 1 (up to eps / denominator)
    w = mixing[layout.block_ids][:, layout.block_ids]
    assert (w[2:, :2] == 1).all()
    torch.testing.assert_close(attn.sum(-1), torch.ones_like(attn.sum(-1)), rtol=0, atol=1e-4)


@pytest.mark.parametrize("num_prefix_tokens", [0, 1])
def test_linear_module_matches_naive(num_prefix_tokens):
    module = LinearAttention(48, 3, qk_norm=True, num_prefix_tokens=num_prefix_tokens).double()
    x = torch.randn(2, num_prefix_tokens + 49, 48, dtype=torch.float64, requires_grad=True)
    q, k, v_heads, v = features(module, x)
    assert_same_values_and_gradients(module, x, finish(module, naive_linear_attention(q, k, v_heads), v, (7, 7)))


def test_one_block_mhla_equals_linear_attention_module():
    mhla = MultiHeadLinearAttention(32, 2, block_grid=(1, 1), lepe_kernel=3)
    linear = LinearAttention(32, 2, lepe_kernel=3)
    linear.load_state_dict(mhla.state_dict(), strict=False)
    x = torch.randn(2, 36, 32)
    assert rel_rms(mhla(x), linear(x)) < 1e-5


def test_qk_norm_is_rmsnorm_over_all_channels():
    module = MultiHeadLinearAttention(48, 3, qk_norm=True)
    assert isinstance(module.q_norm, torch.nn.RMSNorm) and module.q_norm.normalized_shape == (48,)
    assert isinstance(MultiHeadLinearAttention(48, 3).k_norm, torch.nn.Identity)


@pytest.mark.parametrize("attn_layer", [MultiHeadLinearAttention, LinearAttention])
def test_drop_in_for_timm_vision_transformer(attn_layer):
    model = VisionTransformer(img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, num_classes=5,
                              class_token=False, global_pool="avg", attn_layer=attn_layer)
    assert isinstance(model.blocks[0].attn, attn_layer)
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.sum().backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing


def test_timm_block_with_scale_norm_normalises_before_the_projection():
    block = Block(48, 3, qk_norm=True, scale_attn_norm=True, attn_layer=MultiHeadLinearAttention).double()
    attn = block.attn
    assert isinstance(attn.norm, torch.nn.LayerNorm)
    with torch.no_grad():
        attn.norm.weight.uniform_(0.5, 2.0)
        attn.norm.bias.uniform_(-1.0, 1.0)
    x = torch.randn(2, 64, 48, dtype=torch.float64)
    assert rel_rms(attn(x), naive_module_output(attn, x, (8, 8))) < 1e-12
    assert rel_rms(attn(x), naive_module_output(attn, x, (8, 8), norm=False)) > 1e-3  # the norm is really applied


def test_mixing_stays_in_range_through_training_steps():
    module = MultiHeadLinearAttention(16, 2, block_grid=(2, 2), lepe_kernel=0)
    opt = torch.optim.SGD([module.mixing.weight], lr=100.0)
    x = torch.randn(2, 16, 16)
    for _ in range(3):
        opt.zero_grad()
        module(x).pow(2).sum().backward()
        opt.step()
        module(x)
        assert module.mixing.weight.min() >= 0 and module.mixing.weight.max() <= 1


def test_grid_inference_and_dynamic_grid():
    module = MultiHeadLinearAttention(16, 2, block_grid=(2, 2)).double()
    assert module.token_grid(64) == (8, 8)
    x = torch.randn(1, 60, 16, dtype=torch.float64)
    module.grid_size = (6, 10)
    wide = module(x)
    assert rel_rms(wide, naive_module_output(module, x, (6, 10))) < 1e-12
    module.grid_size = (10, 6)  # the same tokens on another grid: other blocks, other LePE neighbours
    assert rel_rms(module(x), naive_module_output(module, x, (10, 6))) < 1e-12
    assert rel_rms(module(x), wide) > 1e-3


@pytest.mark.parametrize("kwargs,x_tokens,match", [
    (dict(grid_size=(7, 7)), 50, "token grid 7x7 \\(49 tokens\\) \\+ 0 prefix tokens does not match N=50"),
    (dict(), 50, "cannot infer a square token grid from N=50"),
    (dict(block_grid=(8, 2)), 49, "block_grid 8x2 is larger than the token grid 7x7"),
])
def test_bad_inputs_at_forward(kwargs, x_tokens, match):
    module = MultiHeadLinearAttention(16, 2, **kwargs)
    with pytest.raises(ValueError, match=match):
        module(torch.randn(1, x_tokens, 16))


@pytest.mark.parametrize("kwargs,match", [
    (dict(transform="sine"), "unknown mixing transform 'sine'"),
    (dict(normalizer="exact"), "unknown normalizer 'exact'"),
    (dict(block_mode="even"), "unknown block_mode 'even'"),
    (dict(grid_size=(3, 3), block_grid=(4, 4)), "block_grid 4x4 is larger than the token grid 3x3"),
    (dict(grid_size=(14, 14), normalizer="official"), "normalizer='official' needs a token grid divisible"),
    (dict(num_prefix_tokens=1, normalizer="official"), "does not support prefix tokens"),
    (dict(attn_drop=0.1), "attn_drop=0.1 is not supported"),
    (dict(lepe_kernel=4), "lepe_kernel must be odd"),
    (dict(scale_norm=True), "scale_norm=True needs a norm_layer"),
    (dict(num_heads=3), "dim \\(16\\) must be divisible by num_heads \\(3\\)"),
    (dict(form="chunked"), "unknown form 'chunked'"),
    (dict(form="parallel", normalizer="official"), "form='parallel' computes the paper normalizer only"),
])
def test_bad_options(kwargs, match):
    kwargs = dict(dict(dim=16, num_heads=2), **kwargs)
    with pytest.raises(ValueError, match=match):
        MultiHeadLinearAttention(**kwargs)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="block_size"):
        MultiHeadLinearAttention(16, 2, block_size=4)


def test_masks_are_refused():
    module = MultiHeadLinearAttention(16, 2)
    with pytest.raises(ValueError, match="supports neither attn_mask nor is_causal"):
        module(torch.randn(1, 16, 16), attn_mask=torch.ones(16, 16, dtype=torch.bool))


def test_bf16_autocast_forward_and_backward():
    module = MultiHeadLinearAttention(48, 3, qk_norm=True)
    x = torch.randn(2, 196, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error")  # no mixed-dtype fallbacks
        out = module(x)
    assert out.dtype == torch.bfloat16
    assert rel_rms(out.float(), module(x)) < 3e-2
    out.float().sum().backward()
    assert torch.isfinite(module.mixing.weight.grad).all()


def test_timm_is_new_enough():
    major, minor, patch = (int(p) for p in timm.__version__.split(".")[:3])
    assert (major, minor, patch) >= (1, 0, 26)


@pytest.mark.parametrize("eps,norm_eps", [(0.1, 1e-6), (1e-6, 0.5)])
def test_feature_eps_and_norm_eps_are_separate(eps, norm_eps):
    module = LinearAttention(48, 3, qk_norm=True, lepe_kernel=0, eps=eps, norm_eps=norm_eps).double()
    assert module.q_norm.eps == module.k_norm.eps == norm_eps and module.eps == eps
    x = torch.randn(2, 16, 48, dtype=torch.float64)
    q, k, v = module.qkv(x).chunk(3, dim=-1)
    q = F.relu(F.rms_norm(q, (48,), module.q_norm.weight, eps=norm_eps)) + eps  # the documented formula
    k = F.relu(F.rms_norm(k, (48,), module.k_norm.weight, eps=norm_eps)) + eps
    q, k, v = (module.split_heads(t) for t in (q, k, v))
    for actual, wanted in zip(module.features(x), (q, k, v), strict=True):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=0)
    out = naive_linear_attention(q, k, v, eps=eps)
    expected = module.proj(out.transpose(1, 2).flatten(2))
    torch.testing.assert_close(module(x), expected, rtol=1e-12, atol=1e-12)
    assert LinearAttention(48, 3, qk_norm=True, eps=0.1).q_norm.eps == 1e-6  # an eps ablation keeps the norm

