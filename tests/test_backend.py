"""backend="auto" | "torch" | "triton": the choice, its one-line errors, and the kernels giving the torch path's
values and gradients in the modules and a model (on the CPU under Triton's interpreter)."""
import copy
import importlib.util

import pytest
import timm
import torch
from helpers import rel_rms

import models  # noqa: F401  (registers the models)
from mhla import LinearAttention, MultiHeadLinearAttention
from mhla import backend as backends

CPU, CUDA, META = (torch.device(name) for name in ("cpu", "cuda", "meta"))


def test_an_unknown_backend_or_triton_without_the_package_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"^unknown backend 'cuda'; expected one of \('auto', 'torch', 'triton'\)$"):
        LinearAttention(64, 2, backend="cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ValueError, match=r"^backend='triton' needs the triton package"):
        MultiHeadLinearAttention(64, 2, backend="triton")
    assert not backends.uses_triton("auto", CUDA)  # auto without triton: the torch path, no message


def test_auto_takes_the_torch_path_on_the_cpu_and_on_cuda_until_a_gpu_has_shown_the_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert [backends.uses_triton(name, CPU) for name in ("auto", "torch", "triton")] == [False, False, True]
    assert backends.uses_triton("auto", CUDA) is backends.TRITON_ON_CUDA_BY_DEFAULT is False
    assert backends.uses_triton("triton", CUDA) and not backends.uses_triton("torch", CUDA)


@pytest.mark.parametrize("device", [CPU, META], ids=["cpu-without-interpreter", "meta"])
def test_an_explicit_triton_that_cannot_run_is_a_one_line_error(device, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=rf"^backend='triton' runs on CUDA tensors \(or on CPU tensors under "
                                         rf"TRITON_INTERPRET=1\), got {device.type} tensors$"):
        backends.uses_triton("triton", device)


def test_the_released_normalizer_has_the_torch_path_only():
    with pytest.raises(ValueError, match="^backend='triton' computes the paper normalizer only, got "
                                         "normalizer='official'$"):
        MultiHeadLinearAttention(64, 2, block_grid=(2, 2), normalizer="official", backend="triton")


def test_backend_is_a_create_model_keyword_of_the_linear_attentions():
    model = timm.create_model("deit_tiny_mhla", backend="triton", depth=2)
    assert [block.attn.backend for block in model.blocks] == ["triton", "triton"]
    assert timm.create_model("deit_tiny_linear_lepe", depth=1).blocks[0].attn.backend == "auto"
    with pytest.raises(ValueError, match="^backend='triton' is not an option of attn_type='softmax'$"):
        timm.create_model("deit_tiny_softmax", backend="triton")


def _forward_backward(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out, x.grad, {name: p.grad for name, p in module.named_parameters()}


def _perturbed(module):
    """Every parameter moved off its initialisation (LePE's zero bias, the norms' ones), so that each one counts."""
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.1 * torch.randn_like(param))
        if hasattr(module, "mixing"):
            module.mixing.weight.clamp_(0, 1)
    return module


MODULES = {
    "mhla-blocks-uneven-prefix": lambda: MultiHeadLinearAttention(64, 2, qk_norm=True, block_grid=(3, 2), form="blocks",
                                                                  grid_size=(7, 9), num_prefix_tokens=1),
    "mhla-parallel-uneven-prefix": lambda: MultiHeadLinearAttention(64, 2, qk_norm=True, block_grid=(3, 2),
                                                                    form="parallel", grid_size=(7, 9),
                                                                    num_prefix_tokens=1),
    "linear-lepe": lambda: LinearAttention(64, 2, qk_norm=True, grid_size=(7, 9), num_prefix_tokens=1),
}


@pytest.mark.parametrize("build", MODULES.values(), ids=MODULES.keys())
def test_the_kernels_give_the_torch_path_s_values_and_gradients_in_the_modules(build, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reference = _perturbed(build())
    kernels = copy.deepcopy(reference)
    kernels.backend = "triton"
    x = torch.randn(2, 64, 64)
    expected, results = _forward_backward(reference, x), _forward_backward(kernels, x)
    assert rel_rms(results[0], expected[0]) < 1e-5 and rel_rms(results[1], expected[1]) < 1e-5
    assert results[2].keys() == expected[2].keys()
    for name, grad in expected[2].items():
        assert rel_rms(results[2][name], grad) < 1e-5, name


def test_a_model_on_the_kernels_gives_the_torch_path_s_logits_and_gradients(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reference = _perturbed(timm.create_model("deit_tiny_mhla", img_size=64, depth=1, num_classes=5))
    kernels = copy.deepcopy(reference)
    for block in kernels.blocks:
        block.attn.backend = "triton"
    x = torch.randn(2, 3, 64, 64)
    expected, results = _forward_backward(reference, x), _forward_backward(kernels, x)
    assert rel_rms(results[0], expected[0]) < 1e-5
    for name, grad in expected[2].items():
        assert rel_rms(results[2][name], grad) < 1e-5, name
