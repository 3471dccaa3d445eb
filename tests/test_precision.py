"""Mixed precision through the whole model on the CPU: bf16 autocast against fp32, for both MHLA forms.

Under autocast the linear layers, the MLP and the head run in the low dtype; the attention from the qkv output
(``mhla.fused.qkv_attention``: q/k RMSNorm, feature map, summaries, normaliser, LePE) runs in fp32 and returns
the low dtype, and the LayerNorms run in fp32 as autocast does everywhere (docs/library.md).
"""
import pytest
import timm
import torch
from helpers import rel_rms

import mhla
import models  # noqa: F401  (registers the models)

# Relative RMS error against fp32 (bf16 keeps 8 bits of mantissa, a unit roundoff of 3.9e-3); measured
# at most 0.4% on the logits and 1.0% on a parameter's gradient (blocks.1.attn.qkv.weight at 224 px).
LOGITS_TOL, GRAD_TOL = 1e-2, 3e-2
CASES = {  # image size, patch size, depth, batch
    "224px": (224, 16, 12, 2),  # DeiT-T as trained
    "64x64tokens": (256, 4, 2, 1),  # 4,096 tokens (two blocks, to keep the CPU time down)
}


def _step(model, images, labels, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(images)
        torch.nn.functional.cross_entropy(logits, labels).backward()
    return logits, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.slow  # about 25 s of bf16 matmuls on the CPU
@pytest.mark.parametrize("form", ["blocks", "parallel"])
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_autocast_matches_fp32_in_logits_and_every_gradient(case, form):
    img_size, patch_size, depth, batch = CASES[case]
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_mhla", img_size=img_size, patch_size=patch_size, depth=depth, form=form,
                              num_classes=10)
    images, labels = torch.randn(batch, 3, img_size, img_size), torch.arange(batch) % 10
    reference, reference_grads = _step(model, images, labels, None)
    logits, grads = _step(model, images, labels, torch.bfloat16)
    assert logits.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads.values())
    assert rel_rms(logits.float(), reference) < LOGITS_TOL
    errors = {name: rel_rms(grads[name], reference_grads[name]) for name in reference_grads}
    assert len(errors) == len(list(model.parameters())) and max(errors.values()) < GRAD_TOL, errors


# Measured: output 3.5e-3 (bf16) and 4.4e-4 (fp16), the worst gradient 5.6e-3 and 1.3e-3, both forms.
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("form", ["blocks", "parallel"])
def test_attention_module_under_autocast_matches_fp32(dtype, tol, form):
    """The module (qkv projection, fused attention, output projection) in fp16 and bf16 autocast on the CPU."""
    torch.manual_seed(0)
    module = mhla.MultiHeadLinearAttention(64, 2, qk_norm=True, grid_size=(8, 8), num_prefix_tokens=1,
                                           block_grid=(2, 2), form=form)
    x = torch.randn(2, 65, 64, requires_grad=True)
    reference = module(x)
    reference.square().mean().backward()
    expected = [x.grad] + [p.grad for p in module.parameters()]
    x.grad = None
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype):
        out = module(x)
        out.float().square().mean().backward()
    assert out.dtype == dtype and rel_rms(out.float(), reference) < tol
    grads = [x.grad] + [p.grad for p in module.parameters()]
    assert all(rel_rms(g, e) < 2 * tol for g, e in zip(grads, expected, strict=True))
