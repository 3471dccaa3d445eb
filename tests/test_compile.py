"""torch.compile of a whole training step (forward, backward, AdamW step) on the CPU: eager's losses, no graph break."""
import copy

import pytest
import timm
import torch

import models  # noqa: F401  (registers the models)

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


@pytest.mark.parametrize("form", ["blocks", "parallel"])
def test_the_attention_compiles_without_a_graph_break(form):
    import mhla

    attention = mhla.MultiHeadLinearAttention(24, 2, qk_norm=True, grid_size=(4, 4), num_prefix_tokens=1,
                                              block_grid=(3, 3), form=form)
    explanation = torch._dynamo.explain(attention)(torch.randn(2, 17, 24))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
