"""Attention matrices from hooks: they reproduce each layer's output; rank and entropy behave."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import models  # noqa: F401  (registers the models)
from mhla.analysis import attention_map, attention_matrix, capture_attention, matrix_rank, row_entropy
from mhla.naive import mhla_attention_matrix


@pytest.mark.parametrize("name,kwargs", [
    ("deit_tiny_mhla", {}), ("deit_tiny_mhla", dict(class_token=True, global_pool="token")),
    ("deit_tiny_mhla", dict(normalizer="official", block_grid=(2, 2))), ("deit_tiny_linear", {}),
    ("deit_tiny_softmax", {}),
])
@pytest.mark.parametrize("fused", [True, False])
def test_matrix_times_v_is_the_layer_output(name, kwargs, fused):
    model = timm.create_model(name, img_size=64, depth=2, **kwargs).eval()
    for block in model.blocks:
        if hasattr(block.attn, "fused_attn"):
            block.attn.fused_attn = fused
    captures = capture_attention(model, torch.randn(2, 3, 64, 64))
    assert len(captures) == 2
    for capture in captures:
        a = attention_matrix(capture)
        out = (a @ capture.v.double()).transpose(1, 2).flatten(2)  # [B, N, C]
        module = capture.module
        if getattr(module, "lepe", None) is not None:
            v = capture.v.transpose(1, 2).flatten(2)
            p = module.num_prefix_tokens
            out = out + F.pad(module.lepe(v[:, p:], module.token_grid(v.shape[1])), (0, 0, p, 0)).double()
        torch.testing.assert_close(out.float(), capture.out, rtol=1e-4, atol=1e-5)


def test_linear_attention_rank_never_exceeds_the_head_dim():
    model = timm.create_model("deit_tiny_linear", img_size=128, depth=1).eval()  # 64 tokens, head dim 64
    capture = capture_attention(model, torch.randn(1, 3, 128, 128))[0]
    capture.q, capture.k = capture.q[..., :16], capture.k[..., :16]  # a head dim of 16 < N = 64
    ranks = matrix_rank(attention_matrix(capture))
    assert ranks.max() <= 16


def test_uniform_rows_have_entropy_ln_n_and_one_hot_rows_zero():
    n = 37
    entropy, clipped = row_entropy(torch.full((2, n, n), 1.0 / n))
    torch.testing.assert_close(entropy, torch.full((2,), math.log(n), dtype=torch.float64))
    assert clipped == 0
    entropy, _ = row_entropy(torch.eye(n)[None])
    assert entropy.abs().max() < 1e-9
    _, clipped = row_entropy(torch.tensor([[0.5, -0.5], [1.0, 0.0]]))
    assert clipped == 0.25


def test_block_diagonal_mhla_rank():
    # W = I and head dim >= block size: each block is a full-rank T x T block, rank = N
    from mhla.blocks import block_layout

    layout = block_layout((8, 8), (2, 2))  # 4 blocks of 16 tokens
    q, k = torch.rand(1, 1, 64, 32, dtype=torch.float64), torch.rand(1, 1, 64, 32, dtype=torch.float64)
    a = mhla_attention_matrix(q, k, torch.eye(4, dtype=torch.float64), layout.block_ids)
    assert int(matrix_rank(a)) == 64
    # with a head dim of 8 < 16 each block contributes rank 8: sum over blocks of min(n_b, d)
    a = mhla_attention_matrix(q[..., :8], k[..., :8], torch.eye(4, dtype=torch.float64), layout.block_ids)
    assert int(matrix_rank(a)) == 32
    assert int(matrix_rank(a, rtol=1e-3)) <= 32


def test_attention_map_is_a_distribution_over_the_patch_grid():
    model = timm.create_model("deit_tiny_mhla", img_size=64, depth=1, class_token=True, global_pool="token").eval()
    capture = capture_attention(model, torch.randn(2, 3, 64, 64))[0]
    heat = attention_map(capture, query=5, grid=(4, 4))
    assert heat.shape == (2, 4, 4) and heat.min() >= 0
    assert (heat.sum((1, 2)) < 1).all()  # the class token takes the rest of the row
    full = attention_matrix(capture)[:, :, 1 + 5].mean(1)  # [B, N] with the class token first
    torch.testing.assert_close(heat.flatten(1), full[:, 1:])


@pytest.mark.parametrize("num_prefix", [0, 1])
def test_lepe_as_a_banded_matrix_reproduces_the_output(num_prefix):
    model = timm.create_model("deit_tiny_mhla", img_size=64, depth=1, class_token=bool(num_prefix),
                              global_pool="token" if num_prefix else "avg").eval()
    attn = model.blocks[0].attn
    with torch.no_grad():  # one kernel per head: the banded matrix is then exact
        kernels = attn.lepe.conv.weight.unflatten(0, (attn.num_heads, attn.head_dim))
        kernels.copy_(kernels[:, :1].expand_as(kernels))
        attn.lepe.conv.bias.zero_()
    capture = capture_attention(model, torch.randn(2, 3, 64, 64))[0]
    a = attention_matrix(capture, include_lepe=True)
    out = (a @ capture.v.double()).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out.float(), capture.out, rtol=1e-4, atol=1e-5)
    banded = attention_matrix(capture, include_lepe=True) - attention_matrix(capture)
    assert (banded[0, 0, num_prefix + 5].abs() > 0).sum() <= 25  # a 5 x 5 neighbourhood at most
