"""torch.compile on the CPU: a whole training step (forward, backward, AdamW step) and the blocks compiled one by one
(config ``compile: blocks``) follow eager's losses; no graph break in the attention."""
import copy

import pytest
import timm
import torch
from helpers import make_image_folder, tiny_config

import models  # noqa: F401  (registers the models)
import train

KWARGS = {"embed_dim": 24, "depth": 1, "num_heads": 2, "patch_size": 8, "block_grid": [2, 2], "num_classes": 5}


def _train(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, steps: int, compiled: bool) -> list:
    """Losses of ``steps`` AdamW steps on one batch; compiled: the model with ``fullgraph=True`` (no graph
    break anywhere in it, the attention's hand-written backward included) and the optimizer step compiled too."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    forward = torch.compile(model, fullgraph=True) if compiled else model
    step = torch.compile(optimizer.step) if compiled else optimizer.step
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(forward(images), labels)
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # compiling on the CPU takes about a minute
def test_compiled_training_step_follows_the_eager_loss_curve():
    """The block form (what DeiT runs from 384 px on; its padding of uneven blocks included: 4 x 4 tokens in
    3 x 3 blocks)."""
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_mhla", img_size=32, form="blocks", **{**KWARGS, "block_grid": [3, 3]})
    images, labels = torch.randn(4, 3, 32, 32), torch.arange(4) % 5
    eager = _train(copy.deepcopy(model), images, labels, 3, compiled=False)
    torch._dynamo.reset()
    compiled = _train(model, images, labels, 3, compiled=True)
    assert eager[2] < eager[0]  # it trains
    assert compiled == pytest.approx(eager, rel=1e-4)  # same losses up to fused-kernel rounding (fp32)


@pytest.mark.slow  # compiling a block for training and for evaluation on the CPU takes about a minute
def test_a_run_with_compiled_blocks_trains_as_eager_with_one_graph_per_mode(tmp_path):
    """``compile: blocks`` in train.py: both blocks compiled in place share one graph for training and one for
    evaluation, the checkpoint keeps the model's keys, and an epoch (EMA on) ends at eager's weights."""
    from torch._dynamo.utils import counters

    config = tiny_config(tmp_path, make_image_folder(tmp_path / "data"), epochs=1)
    for name in ("eager", "blocks"):
        torch._dynamo.reset()
        counters.clear()
        assert train.main(["--config", str(config), "--set", f"run_name={name}", "--set", "model.kwargs.depth=2",
                           "--set", f"compile={'false' if name == 'eager' else 'blocks'}"]) == 0
    assert counters["stats"]["unique_graphs"] == 2
    eager, blocks = (torch.load(tmp_path / "output" / name / "last.pth", weights_only=True)
                     for name in ("eager", "blocks"))
    assert list(blocks["model"]) == list(eager["model"]) and "blocks.1.attn.qkv.weight" in blocks["model"]
    for key in ("model", "ema"):
        for name, value in eager[key].items():
            torch.testing.assert_close(blocks[key][name], value, rtol=1e-4, atol=1e-6, msg=f"{key}: {name}")


@pytest.mark.parametrize("form", ["blocks", "parallel"])
def test_the_attention_compiles_without_a_graph_break(form):
    import mhla

    attention = mhla.MultiHeadLinearAttention(24, 2, qk_norm=True, grid_size=(4, 4), num_prefix_tokens=1,
                                              block_grid=(3, 3), form=form)
    explanation = torch._dynamo.explain(attention)(torch.randn(2, 17, 24))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
