"""What a training forward keeps for backward: at most a bound computed from the shapes, and what softmax keeps."""
import pytest
import timm
import torch

import models  # noqa: F401  (registers the models)
from mhla.benchmark import saved_bytes


def kept(model: torch.nn.Module, x: torch.Tensor, within: torch.nn.Module | None = None) -> int:
    return saved_bytes(lambda: model(x).sum(), exclude=model.parameters(), within=within)


def bound(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes a DeiT training forward needs to keep, from the shapes (fp32).

    Per block and token: norm1 and norm2 keep their input and two statistics (2 C + 4), the
    attention keeps its input, the qkv output and the projection's input (5 C, as SDPA's input,
    output and log-sum-exp do), the MLP its input, fc1's output and GELU's output (9 C): 16 C + 4,
    and MHLA its M x M mixing (computed from the parameter). Outside
    the blocks: the image (patch embedding), the final norm's input and statistics, and the pooled
    features (fc_norm's input and statistics, the head's input).
    """
    batch, tokens, dim = x.shape[0], model.patch_embed.num_patches + model.num_prefix_tokens, model.embed_dim
    attn = model.blocks[0].attn
    per_block = batch * tokens * (16 * dim + 4) + (attn.mixing().numel() if hasattr(attn, "mixing") else 0)
    outside = x.numel() + batch * tokens * (dim + 2) + batch * (2 * dim + 2)
    return 4 * (len(model.blocks) * per_block + outside)


@pytest.mark.parametrize("img_size,batch", [(224, 2), (512, 1)])  # MHLA's parallel form at 224 px, blocks at 512
@pytest.mark.parametrize("name", ["deit_tiny_mhla", "deit_tiny_linear_lepe", "deit_tiny_linear"])
def test_a_training_forward_keeps_no_more_than_the_bound_and_softmax(name, img_size, batch):
    model, softmax = (timm.create_model(n, img_size=img_size) for n in (name, "deit_tiny_softmax"))
    x = torch.randn(batch, 3, img_size, img_size)
    ours = kept(model, x)
    assert ours <= bound(model, x)
    assert ours <= kept(softmax, x)


def test_the_attention_keeps_five_channels_per_token():
    """Its input (for the qkv weight's gradient), qkv (3 C) and the projection's input: nothing recomputable."""
    model = timm.create_model("deit_tiny_mhla", img_size=512)  # 32 x 32 tokens: the block form
    x = torch.randn(1, 3, 512, 512)
    attn = model.blocks[3].attn
    assert kept(model, x, within=attn) == (5 * 32 * 32 * model.embed_dim + attn.mixing().numel()) * 4
