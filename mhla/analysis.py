"""Attention-diversity analysis: capture q, k, v per layer and build each head's N x N attention matrix.

``capture_attention(model, images)`` runs the model once with hooks on every attention layer's
``qkv`` projection (its output) and ``proj`` (its input: the attention output before the
projection). From q, k, v the naive references of ``mhla.naive`` build the matrix A exactly (MHLA's is
the paper's Eq. 4) for MHLA, plain linear attention and timm's softmax ``Attention`` (fused or
not: the hooks sit outside the attention kernel). The LePE term of the linear attentions is left
out of A by default; ``include_lepe=True`` adds it as a banded N x N matrix per head (``lepe_matrix``:
the depthwise convolution written as a matrix, its kernels averaged over the head's channels, which
is exact when they share one kernel).

Metrics per layer and head: numerical rank (float64 SVD; tolerance below), mean row entropy in
nats, and the fraction of negative entries clipped before the entropy (0 for every kind here).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import LinearAttention, MultiHeadLinearAttention
from .naive import linear_attention_matrix, mhla_attention_matrix, softmax_attention_matrix

__all__ = ["LayerCapture", "attention_map", "attention_matrix", "capture_attention", "lepe_matrix", "matrix_rank",
           "row_entropy"]


@dataclass
class LayerCapture:
    """What one attention layer saw and produced in one forward.

    Attributes:
        module: the attention module.
        q, k, v: ``[B, H, N, D]`` as the attention uses them (linear kinds: feature-mapped q, k).
        out: ``[B, N, C]`` the attention output before the projection (LePE included).
    """

    module: nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        if isinstance(self.module, MultiHeadLinearAttention):
            return "mhla"
        return "linear" if isinstance(self.module, LinearAttention) else "softmax"


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, LinearAttention) or (
        hasattr(module, "qkv") and hasattr(module, "proj") and hasattr(module, "num_heads"))


def _softmax_qkv(module: nn.Module, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[B, H, N, D]`` of timm's softmax ``Attention`` from its qkv projection's output."""
    batch, tokens, _ = qkv.shape
    q, k, v = qkv.reshape(batch, tokens, 3, module.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    return module.q_norm(q), module.k_norm(k), v


def capture_attention(model: nn.Module, images: torch.Tensor) -> list[LayerCapture]:
    """Run ``model(images)`` once (no grad) and return one ``LayerCapture`` per attention layer, in order.

    Linear kinds: q, k, v are the module's own ``features`` of its input; softmax: from its qkv output.
    """
    captures: list[LayerCapture] = []
    handles = []
    for module in model.modules():
        if not _is_attention(module):
            continue

        def on_input(_, inputs, module=module):
            captures.append(LayerCapture(module, *(t.detach() for t in module.features(inputs[0]))))

        def on_qkv(_, __, output, module=module):
            captures.append(LayerCapture(module, *(t.detach() for t in _softmax_qkv(module, output))))

        def on_proj(_, inputs, module=module):
            captures[-1].out = inputs[0].detach()

        if isinstance(module, LinearAttention):
            handles.append(module.register_forward_pre_hook(on_input))
        else:
            handles.append(module.qkv.register_forward_hook(on_qkv))
        handles.append(module.proj.register_forward_pre_hook(on_proj))
    try:
        with torch.no_grad():
            model(images)
    finally:
        for handle in handles:
            handle.remove()
    return captures


def lepe_matrix(module: LinearAttention, grid: tuple[int, int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """LePE as banded matrices ``[H, P + N, P + N]`` over the whole sequence (zero rows/columns for the P
    prefix tokens): entry (t, s) is the head-averaged kernel weight that token s gets in token t's
    output. The bias is not included."""
    conv = module.lepe.conv
    gh, gw = grid
    num = gh * gw
    kernel = conv.weight.detach().to(dtype)[:, 0].unflatten(0, (module.num_heads, module.head_dim)).mean(1)
    eye = torch.eye(num, dtype=dtype, device=kernel.device).view(num, 1, gh, gw)  # one image per source token
    heads = [F.conv2d(eye, kernel[h][None, None], padding=conv.padding) for h in range(module.num_heads)]
    banded = torch.stack([m.flatten(1).T for m in heads])  # [H, N (target), N (source)]
    prefix = module.num_prefix_tokens
    return F.pad(banded, (prefix, 0, prefix, 0))


def attention_matrix(capture: LayerCapture, dtype: torch.dtype = torch.float64,
                     include_lepe: bool = False) -> torch.Tensor:
    """The layer's attention matrix A ``[B, H, N, N]``, so that A @ v is the attention output (plus LePE
    with ``include_lepe``, up to its bias, for linear kinds)."""
    a = _attention_only(capture, dtype)
    module = capture.module
    if include_lepe and getattr(module, "lepe", None) is not None:
        grid = module.token_grid(a.shape[-1])
        a = a + lepe_matrix(module, grid, dtype).to(a.device)
    return a


def _attention_only(capture: LayerCapture, dtype: torch.dtype) -> torch.Tensor:
    q, k = capture.q.to(dtype), capture.k.to(dtype)
    module = capture.module
    if capture.kind == "softmax":
        return softmax_attention_matrix(q, k, scale=module.scale)
    if capture.kind == "linear":
        return linear_attention_matrix(q, k, eps=module.eps)
    layout = module.layout(module.token_grid(q.shape[-2]), q.device)
    mixing = module.full_mixing(layout).detach().to(dtype)
    return mhla_attention_matrix(q, k, mixing, layout.block_ids, normalizer=module.normalizer, eps=module.eps)


def attention_map(capture: LayerCapture, query: int, grid: tuple[int, int]) -> torch.Tensor:
    """Head-averaged attention of patch ``query`` (raster index) over the patch tokens, ``[B, gh, gw]``."""
    prefix = getattr(capture.module, "num_prefix_tokens", 0)
    a = attention_matrix(capture)[:, :, prefix + query, prefix:]  # [B, H, gh * gw]
    return a.mean(1).unflatten(-1, grid)


def matrix_rank(a: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Numerical rank of each ``[..., N, N]`` matrix, in float64.

    ``rtol=None`` is ``torch.linalg.matrix_rank``'s default: singular values above
    ``sigma_max * N * eps(float64)``; a fixed ``rtol`` (e.g. 1e-3) counts those above ``rtol * sigma_max``.
    """
    return torch.linalg.matrix_rank(a.double(), rtol=rtol)


def row_entropy(a: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Mean entropy (nats) of the rows of ``[..., N, N]``, each renormalised to sum 1, and the fraction of
    entries that were negative and clipped to 0 first."""
    a = a.double()
    clipped = float((a < 0).double().mean())
    p = a.clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return entropy.mean(-1), clipped
