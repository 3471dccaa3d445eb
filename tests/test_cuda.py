"""On a CUDA device: the attention and DeiT-T MHLA under bf16 and fp16 autocast against float64, the block and
parallel forms, AMP training steps, channels_last / non_blocking input transfers, and the Triton kernels against the
fp32 torch path.

Skipped without a device (``tests/conftest.py``); ``scripts/gpu_check.py`` runs them on a GPU machine. Every input
and every initialisation is drawn on the CPU (under the autouse seed) and moved to ``DEVICE``, so the device sees the
numbers the tolerances below were measured with; the references are float64 on the device itself (no TF32 there).
"""
import copy
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import load_script, rel_rms
from torch.utils.data import DataLoader, TensorDataset

import mhla.attention
import mhla.fused
import mhla.kernels
import models  # noqa: F401  (registers the models)
from mhla import LinearAttention, MultiHeadLinearAttention, block_layout, qkv_attention

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
C, H = 192, 3  # DeiT-T's width and heads: head dim 64
LOW = [torch.bfloat16, torch.float16]
# Relative RMS error (helpers.rel_rms) against float64 on unrounded inputs, per autocast dtype. bf16 keeps 8
# significant bits, fp16 11. Measured with these inputs under CPU autocast (bf16 / fp16): the op 4.4e-3 / 4.9e-4
# (the H200 check: 4e-3 / 4e-4), a module 6.4e-3 / 1.6e-3, DeiT-T's logits, input gradient and whole gradient
# 6.7e-3 / 1.8e-3 at most, one parameter's gradient 1.1e-2 / 2.6e-3 at most. Each bound is 4-5.5x that, room for
# cuBLAS's reduced-precision reductions in bf16 and fp16 GEMMs (on by default) and other kernels' rounding.
TOL = {
    "op": {torch.bfloat16: 2e-2, torch.float16: 2.5e-3},  # test_ops.py's bf16 bound
    "module": {torch.bfloat16: 3e-2, torch.float16: 8e-3},
    "model": {torch.bfloat16: 3e-2, torch.float16: 8e-3},
    "parameter": {torch.bfloat16: 6e-2, torch.float16: 1.2e-2},
}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters()}


def assert_grads_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    errors = {name: rel_rms(got[name], want[name]) for name in got}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, f"gradient of {worst}: relative error {errors[worst]:.2e}"


# The op


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("kind,grid", [
    ("parallel", (14, 14)),  # 224 px: MHLA's N x N form, unequal blocks (4, 4, 3, 3)
    ("blocks", (14, 14)),    # the block form with masked slots
    ("blocks", (32, 32)),    # 512 px, evenly divided
    ("linear", (14, 14)),    # plain linear attention
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_op_under_autocast_matches_float64(kind, grid, dtype):
    """``qkv_attention`` on a bf16/fp16 ``qkv`` under autocast: fp32 inside, output and qkv's gradient in the low
    dtype, the parameters' gradients in fp32; values and every gradient against float64 on the unrounded inputs."""
    num_tokens = grid[0] * grid[1]
    qkv = torch.randn(2, num_tokens, 3 * C, dtype=torch.float64)
    params = dict(q_weight=1 + 0.3 * torch.randn(C, dtype=torch.float64),
                  k_weight=1 + 0.3 * torch.randn(C, dtype=torch.float64),
                  lepe_weight=0.1 * torch.randn(C, 1, 5, 5, dtype=torch.float64),
                  lepe_bias=0.1 * torch.randn(C, dtype=torch.float64))
    layout = None
    if kind != "linear":
        layout = block_layout(grid, (4, 4), device=torch.device(DEVICE))
        params["mixing"] = torch.rand(16, 16, dtype=torch.float64)
    grad_out = torch.randn(2, num_tokens, C, dtype=torch.float64).to(DEVICE)

    def run(qkv, params, grad_out):
        out = qkv_attention(qkv, H, layout=layout, parallel=kind == "parallel", grid_size=grid, **params)
        got = torch.autograd.grad(out, [qkv, *params.values()], grad_out.to(out.dtype))
        return out, dict(zip(["qkv", *params], got, strict=True))

    ref_params = {name: p.to(DEVICE).requires_grad_() for name, p in params.items()}
    expected, expected_grads = run(qkv.to(DEVICE).requires_grad_(), ref_params, grad_out)
    low_params = {name: p.float().to(DEVICE).requires_grad_() for name, p in params.items()}
    with torch.autocast(DEVICE, dtype=dtype):
        out, got = run(qkv.to(DEVICE, dtype).requires_grad_(), low_params, grad_out)
    assert out.dtype == dtype and got["qkv"].dtype == dtype
    assert all(got[name].dtype == torch.float32 for name in params)
    assert rel_rms(out, expected) < TOL["op"][dtype]
    assert_grads_close(got, expected_grads, TOL["op"][dtype])


# The modules and the two forms


def make_module(kind: str, grid: tuple[int, int], num_prefix_tokens: int = 0) -> torch.nn.Module:
    """DeiT-T's attention layer (RMSNorm q/k, LePE 5 x 5), MHLA with 4 x 4 blocks in the given form, on the CPU."""
    if kind == "linear":
        return LinearAttention(C, H, qk_norm=True, grid_size=grid, num_prefix_tokens=num_prefix_tokens)
    return MultiHeadLinearAttention(C, H, qk_norm=True, grid_size=grid, num_prefix_tokens=num_prefix_tokens, form=kind)


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("kind,grid", [("parallel", (14, 14)), ("blocks", (14, 14)), ("auto", (16, 16)),
                                       ("linear", (14, 14))],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_module_under_autocast_matches_float64(kind, grid, dtype):
    module = make_module(kind, grid)
    reference = copy.deepcopy(module).double().to(DEVICE)
    module.to(DEVICE)
    x = torch.randn(2, grid[0] * grid[1], C)
    grad_out = torch.randn(2, grid[0] * grid[1], C).to(DEVICE)
    x_ref, x_low = x.double().to(DEVICE).requires_grad_(), x.to(DEVICE).requires_grad_()
    expected = reference(x_ref)
    expected.backward(grad_out.double())
    with torch.autocast(DEVICE, dtype=dtype):
        out = module(x_low)
    assert out.dtype == dtype
    out.backward(grad_out.to(dtype))
    assert rel_rms(out, expected) < TOL["module"][dtype]
    assert rel_rms(x_low.grad, x_ref.grad) < TOL["module"][dtype]
    assert_grads_close(grads(module), grads(reference), TOL["module"][dtype])


@pytest.mark.parametrize("grid,num_prefix_tokens", [((14, 14), 0), ((16, 16), 0), ((7, 9), 1)],
                         ids=["14x14", "16x16", "7x9-prefix"])
def test_block_and_parallel_forms_agree(grid, num_prefix_tokens):
    """The same module computed both ways, in float64 on the device: output and every gradient."""
    blocks = make_module("blocks", grid, num_prefix_tokens).double().to(DEVICE)
    parallel = copy.deepcopy(blocks)
    parallel.form = "parallel"
    x = torch.randn(2, num_prefix_tokens + grid[0] * grid[1], C, dtype=torch.float64).to(DEVICE)
    results = []
    for module in (blocks, parallel):
        x_ = x.clone().requires_grad_()
        out = module(x_)
        out.backward(torch.ones_like(out))
        results.append((out, x_.grad, grads(module)))
    (out_b, grad_b, params_b), (out_p, grad_p, params_p) = results
    assert rel_rms(out_p, out_b) < 1e-10 and rel_rms(grad_p, grad_b) < 1e-10
    assert_grads_close(params_p, params_b, 1e-10)


def test_auto_form_computes_what_uses_parallel_form_says(monkeypatch):
    chosen = []
    fused = mhla.attention.qkv_attention

    def spy(*args, parallel=False, **kwargs):
        chosen.append(parallel)
        return fused(*args, parallel=parallel, **kwargs)

    monkeypatch.setattr(mhla.attention, "qkv_attention", spy)
    module = MultiHeadLinearAttention(C, H, qk_norm=True).to(DEVICE)  # form="auto", grid inferred per call
    expected = []
    for side in (14, 16, 32):  # 224, 256 and 512 px
        module(torch.randn(1, side * side, C).to(DEVICE))
        expected.append(module.uses_parallel_form(module.layout((side, side), torch.device(DEVICE))))
    assert chosen == expected == [True, False, False]


# The model


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_deit_tiny_mhla_under_autocast_matches_float64(dtype):
    """Forward and backward of ``deit_tiny_mhla`` at 224 px (the parallel form) against the float64 model."""
    model = timm.create_model("deit_tiny_mhla")
    reference = copy.deepcopy(model).double().to(DEVICE)
    model.to(DEVICE)
    x = torch.randn(2, 3, 224, 224)
    target = torch.tensor([1, 2]).to(DEVICE)
    x_ref, x_low = x.double().to(DEVICE).requires_grad_(), x.to(DEVICE).requires_grad_()
    expected = reference(x_ref)
    F.cross_entropy(expected, target).backward()
    with torch.autocast(DEVICE, dtype=dtype):
        logits = model(x_low)
        loss = F.cross_entropy(logits, target)
    loss.backward()
    tol = TOL["model"][dtype]
    assert rel_rms(logits, expected) < tol
    assert rel_rms(x_low.grad, x_ref.grad) < tol
    got, want = grads(model), grads(reference)
    assert rel_rms(torch.cat([g.flatten() for g in got.values()]),
                   torch.cat([g.flatten() for g in want.values()])) < tol
    assert_grads_close(got, want, TOL["parameter"][dtype])


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_amp_training_steps_learn_a_fixed_batch(dtype):
    """AMP as the trainer runs it: fp16 with a GradScaler, bf16 without; 8 AdamW steps on one batch of 8 images."""
    model = timm.create_model("deit_tiny_mhla", img_size=128, num_classes=10).to(DEVICE)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE) if dtype == torch.float16 else None
    x, target = torch.randn(8, 3, 128, 128).to(DEVICE), (torch.arange(8) % 10).to(DEVICE)
    losses = []
    for _ in range(8):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=dtype):
            loss = F.cross_entropy(model(x), target)
        losses.append(loss.item())
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:  # the first steps may overflow at the initial scale and be skipped
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < 0.5 * losses[0], losses  # 2.39 -> 0.14 under CPU autocast
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert not unchanged
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


# Input transfers and memory formats


def test_pinned_non_blocking_channels_last_batches_equal_the_cpu_batches():
    images, labels = torch.randn(8, 3, 64, 64), torch.arange(8)
    loader = DataLoader(TensorDataset(images, labels), batch_size=4, pin_memory=True)
    for i, (x, y) in enumerate(loader):
        assert x.is_pinned() == (DEVICE == "cuda")  # pinned for the device (a CPU has nothing to pin for)
        x_dev = x.to(DEVICE, non_blocking=True, memory_format=torch.channels_last)
        y_dev = y.to(DEVICE, non_blocking=True)
        assert x_dev.device.type == torch.device(DEVICE).type
        assert x_dev.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x_dev.cpu(), images[4 * i:4 * i + 4]) and torch.equal(y_dev.cpu(), labels[4 * i:4 * i + 4])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
def test_channels_last_gives_the_contiguous_output_and_gradient(dtype, tol):
    """A channels_last input (and a channels_last model, its convolutions' weights) gives the contiguous input's
    logits and input gradient, up to the convolution algorithms cuDNN picks for each layout (TF32 in float32)."""
    model = timm.create_model("deit_tiny_mhla").to(DEVICE)
    x = torch.randn(2, 3, 224, 224).to(DEVICE)

    def run(model, x):
        x = x.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32):
            out = model(x)
        out.float().sum().backward()
        return out.detach(), x.grad

    out, grad = run(model, x)
    x_last = x.contiguous(memory_format=torch.channels_last)
    for candidate in (model, copy.deepcopy(model).to(memory_format=torch.channels_last)):
        out_last, grad_last = run(candidate, x_last)
        assert grad_last.is_contiguous(memory_format=torch.channels_last)
        assert rel_rms(out_last, out) < tol and rel_rms(grad_last, grad) < tol


# The benchmarks: compiled ops, in-process peak memory


@pytest.mark.parametrize("method", ["linear", "mhla"])
def test_compiled_op_matches_the_eager_op_in_bfloat16(method):
    """What ``scripts/benchmark_attention.py --compile`` times: the op compiled (static shapes) gives the eager op's
    output and gradients (bf16 inputs at 1,024 tokens, B = 2, H = 3, D = 64; MHLA with 4 x 4 blocks)."""
    benchmark_attention = load_script("benchmark_attention")
    shape = (2, H, 1024, C // H)
    inputs = [torch.rand(shape), torch.rand(shape), torch.randn(shape)]
    if method == "mhla":
        layout = block_layout((32, 32), (4, 4))
        inputs = [layout.to_blocks(t) for t in inputs] + [torch.rand(16, 16)]
    grad_out = torch.randn(inputs[2].shape).to(DEVICE, torch.bfloat16)

    def run(fn):
        leaves = [t.to(DEVICE, torch.bfloat16) for t in inputs[:3]] + [t.to(DEVICE) for t in inputs[3:]]  # W: fp32
        leaves = [t.requires_grad_() for t in leaves]
        out = fn(*leaves)
        return out, torch.autograd.grad(out, leaves, grad_out)

    eager = run(benchmark_attention.op(method, False))
    compiled = run(benchmark_attention.op(method, True))
    for got, want in zip((compiled[0], *compiled[1]), (eager[0], *eager[1]), strict=True):
        assert rel_rms(got, want) < TOL["op"][torch.bfloat16]


def test_in_process_peak_memory_equals_a_fresh_process_s():
    """On CUDA, ``scripts/benchmark.py`` reads the peak memory of the timed calls in its own process, beside the
    other models' calls; a fresh process per call (what it does on the CPU) reads the same within 5%."""
    benchmark = load_script("benchmark")
    args = benchmark.parse_args(["--models", "deit_tiny_softmax", "deit_tiny_mhla", "--img-sizes", "224",
                                 "--batch-size", "8", "--dtype", "bfloat16", "--device", DEVICE,
                                 "--min-run-time", "0.05", "--rounds", "1"])
    _, peaks = benchmark.measure_size(args, 224)
    for mode in benchmark.MODES:  # MHLA's: two fresh processes
        peak = peaks[("deit_tiny_mhla", mode)]
        assert peak == pytest.approx(benchmark.measure_memory(args, "deit_tiny_mhla", 224, mode), rel=0.05), mode
        assert peak > 1.0


# The Triton kernels: bf16 / fp16 inputs against the fp32 torch path (fla's bounds), run to run determinism

# Relative RMS (helpers.rel_rms), fla's bounds for its kernels. The reference is the torch path in fp32 on the
# device (no LePE, so no convolution; PyTorch's fp32 matmuls are not TF32 by default). Under Triton's CPU interpreter
# the fp16 cases give 2e-4 - 5e-4 against it; its bf16 tl.dot multiplies bit patterns (triton#11584), so bf16 has
# no CPU figure.
KERNEL_TOL = {"output": 5e-3, "gradient": 1e-2}
KERNEL_CASES = {  # name: (token grid, block grid, prefix tokens, head dim, heads)
    "7x9-prefix-3x2-D32": ((7, 9), (3, 2), 1, 32, 2),
    "7x9-prefix-3x2-D64": ((7, 9), (3, 2), 1, 64, 2),
    "14x14-4x4-D64-H3": ((14, 14), (4, 4), 0, 64, 3),  # DeiT-T's layer at 224 px
}


def kernel_inputs(case: str) -> tuple[torch.Tensor, int, dict]:
    """qkv ``[2, N, 3C]`` (fp32), the heads and the parameters (norm weights, W, layout), drawn on the CPU."""
    grid, blocks, prefix, head_dim, heads = KERNEL_CASES[case]
    layout = block_layout(grid, blocks, num_prefix_tokens=prefix, device=torch.device(DEVICE))
    dim, num_blocks = heads * head_dim, layout.num_blocks + layout.num_prefix_blocks
    params = dict(q_weight=1 + 0.2 * torch.randn(dim), k_weight=1 + 0.2 * torch.randn(dim),
                  mixing=torch.rand(num_blocks, num_blocks))
    return torch.randn(2, layout.num_tokens, 3 * dim), heads, dict(params, layout=layout)


def kernel_run(attention, qkv: torch.Tensor, heads: int, kwargs: dict, parallel: bool, dtype: torch.dtype):
    """``attention``'s output and the gradients of qkv (in ``dtype``) and of the fp32 parameters."""
    names = ["q_weight", "k_weight", "mixing"]
    leaves = [qkv.to(DEVICE, dtype).requires_grad_()] + [kwargs[name].to(DEVICE).requires_grad_() for name in names]
    out = attention(leaves[0], heads, parallel=parallel, layout=kwargs["layout"],
                    **dict(zip(names, leaves[1:], strict=True)))
    grad_out = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(DEVICE, out.dtype)
    return out, dict(zip(["qkv", *names], torch.autograd.grad(out, leaves, grad_out), strict=True))


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("parallel", [False, True], ids=["blocks", "parallel"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernels_in_low_precision_match_the_fp32_torch_path(case, parallel, dtype):
    qkv, heads, kwargs = kernel_inputs(case)
    expected, expected_grads = kernel_run(mhla.fused.qkv_attention, qkv, heads, kwargs, parallel, torch.float32)
    out, got = kernel_run(mhla.kernels.qkv_attention, qkv, heads, kwargs, parallel, dtype)
    assert out.dtype == dtype and got["qkv"].dtype == dtype
    assert rel_rms(out, expected) <= KERNEL_TOL["output"]
    for name, grad in expected_grads.items():
        assert rel_rms(got[name], grad) <= KERNEL_TOL["gradient"], name


@pytest.mark.parametrize("parallel", [False, True], ids=["blocks", "parallel"])
def test_kernels_give_bitwise_identical_results_run_to_run(parallel):
    qkv, heads, kwargs = kernel_inputs("14x14-4x4-D64-H3")
    first, second = (kernel_run(mhla.kernels.qkv_attention, qkv, heads, kwargs, parallel, torch.bfloat16)
                     for _ in range(2))
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[1][name], second[1][name]) for name in first[1])


def test_deit_tiny_mhla_training_step_on_the_kernels_matches_the_torch_path_under_bf16_autocast():
    """One forward, cross-entropy and backward of ``deit_tiny_mhla`` (224 px, the parallel form) per backend."""
    model = timm.create_model("deit_tiny_mhla")
    x, target = torch.randn(2, 3, 224, 224).to(DEVICE), torch.tensor([1, 2]).to(DEVICE)
    results = []
    for backend in ("torch", "triton"):
        candidate = copy.deepcopy(model).to(DEVICE)
        for block in candidate.blocks:
            block.attn.backend = backend
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits = candidate(x)
            loss = F.cross_entropy(logits, target)
        loss.backward()
        results.append((logits, grads(candidate)))
    (expected, want), (logits, got) = results
    # A whole model's bounds under bf16 autocast (TOL), not the op's: 12 blocks of bf16 operands in the kernels
    # against the torch path's fp32 inside; under the CPU interpreter in fp16 the deepest blocks' norm-weight
    # gradients already differed by up to 4.75e-2, more than the op's 1e-2
    assert rel_rms(logits, expected) <= TOL["model"][torch.bfloat16]
    assert_grads_close(got, want, TOL["parameter"][torch.bfloat16])
