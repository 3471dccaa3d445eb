"""Attention modules, drop-in for timm's ``attn_layer``: ``MultiHeadLinearAttention`` and ``LinearAttention``.

Both take ``x`` ``[B, N, C]``, N = P prefix tokens (class/register tokens) followed by the patch
tokens of a ``gh x gw`` grid in raster order, and return ``[B, N, C]``:

    x       = LayerNorm(x)                  # with input_norm=True only (the released code's)
    q, k, v = qkv(x)                        # [B, N, C] each
    q, k    = RMSNorm(q), RMSNorm(k)        # over C, with qk_norm=True (paper); epsilon norm_eps
    phi(x)  = ReLU(x) + feature_eps         # feature_eps defaults to eps, which also guards the denominator
    o       = attention(phi(q), phi(k), v)  # per head, head dim C / H
    out     = proj(o + LePE(v))             # LePE on the patch tokens only

By default there is no LayerNorm inside: timm's block already normalises the input (``norm1``). The
released code has a second one (``input_norm=True``): redundant as a design, but its trained affine
weights change the output, so its checkpoints need it.

Prefix tokens in MHLA: they form extra key blocks that every query reads with weight 1, and their
own queries read every block with weight 1 (plain linear attention over all tokens). In matrix
form W is extended to ``[[W, 1], [1, 1]]``, so rows of the attention matrix still sum to 1.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from .backend import check_backend, uses_triton
from .blocks import MODES, BlockLayout, block_layout
from .fused import qkv_attention
from .lepe import LePE
from .mixing import MixingMatrix
from .ops import NORMALIZERS, mhla_attention

__all__ = ["FORMS", "LinearAttention", "MultiHeadLinearAttention"]

FORMS = ("auto", "blocks", "parallel")
# The parallel (N x N) form is chosen while its multiply-adds are at most this many times the block
# form's: its two large matmuls run ~2-3x more efficiently than the block form's many small ones
# (measured by scripts/benchmark_attention.py on CPU), so below this point it is faster.
PARALLEL_ADVANTAGE = 2.0


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply ``norm`` in its weight's dtype (fp32 under autocast), as RMSNorm has no mixed-dtype kernel."""
    if isinstance(norm, nn.RMSNorm) and norm.weight is not None:
        x = x.to(norm.weight.dtype)
    return norm(x)


class LinearAttention(nn.Module):
    """Plain ReLU linear attention (one global summary per head), the paper's baseline.

    Args:
        dim: channels C.
        num_heads: heads H; C must be divisible by H.
        qkv_bias: bias in the qkv projection.
        qk_norm: RMSNorm on q and k over all C channels (the paper's choice; timm's softmax
            ``Attention`` normalises per head instead).
        proj_bias: bias in the output projection.
        attn_drop: must be 0 (there is no attention matrix to drop).
        proj_drop: dropout after the output projection.
        norm_layer: norm before the output projection, used when ``scale_norm=True`` (as in timm).
        scale_norm: normalise the attention output before the projection.
        grid_size: token grid ``(gh, gw)``; None infers a square grid from N - P. Settable as
            an attribute between forwards (e.g. for dynamic image sizes).
        num_prefix_tokens: P tokens before the patch tokens.
        lepe_kernel: LePE depthwise kernel size, 0 for none.
        eps: the denominator's epsilon, and the feature map's offset (``phi(x) = ReLU(x) + eps``) unless
            ``feature_eps`` is given.
        feature_eps: the feature map's offset; None (default) uses ``eps``. The released linear baseline
            uses 0 (``phi(x) = ReLU(x)``) with ``eps=1e-6`` in the denominator.
        norm_eps: epsilon of the q/k RMSNorm (``qk_norm=True``), apart from ``eps`` as in fla, so that
            an ``eps`` ablation leaves the norm alone; None uses the dtype's epsilon, as
            ``nn.RMSNorm(dim)`` in the released MHLA code.
        input_norm: a LayerNorm (eps 1e-5, affine) on the attention's input, as the released MHLA code has.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``: the torch path or the Triton kernels
            (``mhla.backend``); the same method either way.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: type[nn.Module] | None = None,
            *,
            scale_norm: bool = False,
            grid_size: tuple[int, int] | None = None,
            num_prefix_tokens: int = 0,
            lepe_kernel: int = 5,
            eps: float = 1e-6,
            feature_eps: float | None = None,
            norm_eps: float | None = 1e-6,
            input_norm: bool = False,
            backend: str = "auto",
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if attn_drop:
            raise ValueError(f"attn_drop={attn_drop} is not supported: linear attention has no attention matrix")
        if scale_norm and norm_layer is None:
            raise ValueError("scale_norm=True needs a norm_layer")
        if num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
        check_backend(backend)
        self.backend = backend
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.grid_size = None if grid_size is None else tuple(grid_size)
        self.num_prefix_tokens = num_prefix_tokens
        self.eps = eps
        self.feature_eps = eps if feature_eps is None else feature_eps

        self.input_norm = nn.LayerNorm(dim, eps=1e-5, **dd) if input_norm else nn.Identity()
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.q_norm = nn.RMSNorm(dim, eps=norm_eps, **dd) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(dim, eps=norm_eps, **dd) if qk_norm else nn.Identity()
        self.lepe = LePE(dim, lepe_kernel, **dd) if lepe_kernel else None
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def token_grid(self, num_tokens: int) -> tuple[int, int]:
        """The ``(gh, gw)`` grid of the patch tokens in a sequence of ``num_tokens``."""
        num_patches = num_tokens - self.num_prefix_tokens
        if self.grid_size is not None:
            gh, gw = self.grid_size
            if gh * gw != num_patches:
                raise ValueError(
                    f"token grid {gh}x{gw} ({gh * gw} tokens) + {self.num_prefix_tokens} prefix tokens "
                    f"does not match N={num_tokens}")
            return gh, gw
        side = math.isqrt(max(num_patches, 0))
        if num_patches < 1 or side * side != num_patches:
            raise ValueError(
                f"cannot infer a square token grid from N={num_tokens} tokens ({self.num_prefix_tokens} prefix); "
                f"set grid_size")
        return side, side

    def features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of ``x`` ``[B, N, C]`` as the attention uses them, each ``[B, H, N, C / H]``.

        q and k are feature-mapped: RMSNorm over all C channels (``qk_norm``), then
        ``ReLU(x) + feature_eps``; v is a view of the qkv projection's output (after ``input_norm``).
        Autograd through these steps is the reference that ``forward``'s fused path reproduces.
        """
        return self._features(self.qkv(self.input_norm(x)))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """``x`` ``[B, N, C]`` -> ``[B, N, C]``."""
        if attn_mask is not None or is_causal:
            raise ValueError(f"{type(self).__name__} supports neither attn_mask nor is_causal")
        grid = self.token_grid(x.shape[1])
        qkv = self.qkv(self.input_norm(x))  # [B, N, 3C]
        out = self._attend(qkv, grid)  # [B, N, C], LePE included
        return self.proj_drop(self.proj(self.norm(out)))

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, N, C]`` -> ``[B, H, N, C / H]`` (a view)."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _features(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``features`` from the qkv projection's output ``[B, N, 3C]``."""
        q, k, v = qkv.chunk(3, dim=-1)  # [B, N, C] each
        q = F.relu(_norm(self.q_norm, q)) + self.feature_eps
        k = F.relu(_norm(self.k_norm, k)) + self.feature_eps
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def _fused_options(self) -> dict:
        """``qkv_attention``'s keywords for this module's feature map, denominator and LePE."""
        norm = isinstance(self.q_norm, nn.RMSNorm)
        conv = None if self.lepe is None else self.lepe.conv
        return dict(q_weight=self.q_norm.weight if norm else None, k_weight=self.k_norm.weight if norm else None,
                    norm_eps=self.q_norm.eps if norm else None, feature_eps=self.feature_eps, eps=self.eps,
                    lepe_weight=None if conv is None else conv.weight, lepe_bias=None if conv is None else conv.bias)

    def _qkv_attention(self, device: torch.device):
        """``qkv_attention`` of the backend that runs on ``device``: the torch path's or the kernels'."""
        if not uses_triton(self.backend, device):
            return qkv_attention
        from .kernels import qkv_attention as kernels  # imports triton

        return kernels

    def _attend(self, qkv: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """The qkv projection's output ``[B, N, 3C]`` -> the attention output with LePE ``[B, N, C]``."""
        return self._qkv_attention(qkv.device)(qkv, self.num_heads, grid_size=grid, **self._fused_options())


class MultiHeadLinearAttention(LinearAttention):
    """MHLA: linear attention over M token blocks with a learnable mixing of the block summaries.

    Takes every argument of ``LinearAttention`` (``*args`` and ``**kwargs`` are passed on to it), and:

    Args:
        block_grid: ``(bh, bw)`` blocks, M = bh * bw (paper: 4 x 4).
        block_mode: ``"balanced"`` unequal blocks for grids that do not split evenly (14 x 14 into
            4 x 4 -> rows of 4, 4, 3, 3), or ``"pad"``, the released code's even split with the
            padding in the last blocks. Empty slots are masked out of every sum either way.
        transform: mixing initialisation, one of ``mhla.mixing.TRANSFORMS`` (paper: ``linear``).
        mixing_norm: ``rows`` (paper), ``columns`` (released code) or ``none``.
        mixing_sigma: sigma of the ``exp`` and ``gaussian`` transforms.
        learnable_mixing: False freezes W at its initialisation.
        constrain_mixing: keep W in [0, 1] (paper); False only for ablations.
        normalizer: ``"paper"`` (Eq. 4) or ``"official"`` (released code; evenly divided grids and
            no prefix tokens only).
        form: how the output is computed, the same either way: ``"blocks"`` (per-block summaries,
            O(N), ``mhla.ops.mhla_attention``), ``"parallel"`` (the N x N form,
            ``mhla.ops.mhla_attention_parallel``; paper normalizer only) or ``"auto"``: parallel
            while its cost is at most ``PARALLEL_ADVANTAGE`` times the block form's (at head dim
            64 and 4 x 4 blocks: up to 14 x 14 tokens), blocks beyond.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            *args,
            block_grid: tuple[int, int] = (4, 4),
            block_mode: str = "balanced",
            transform: str = "linear",
            mixing_norm: str = "rows",
            mixing_sigma: float | None = None,
            learnable_mixing: bool = True,
            constrain_mixing: bool = True,
            normalizer: str = "paper",
            form: str = "auto",
            **kwargs,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        if block_mode not in MODES:
            raise ValueError(f"unknown block_mode {block_mode!r}; expected one of {MODES}")
        if normalizer not in NORMALIZERS:
            raise ValueError(f"unknown normalizer {normalizer!r}; expected one of {NORMALIZERS}")
        if normalizer == "official" and self.num_prefix_tokens:
            raise ValueError("normalizer='official' does not support prefix tokens")
        if form not in FORMS:
            raise ValueError(f"unknown form {form!r}; expected one of {FORMS}")
        if form == "parallel" and normalizer != "paper":
            raise ValueError(f"form='parallel' computes the paper normalizer only, got normalizer={normalizer!r}")
        if self.backend == "triton" and normalizer != "paper":
            raise ValueError(f"backend='triton' computes the paper normalizer only, got normalizer={normalizer!r}")
        self.block_grid = tuple(block_grid)
        self.block_mode = block_mode
        self.normalizer = normalizer
        self.form = form
        self.mixing = MixingMatrix(
            self.block_grid, transform, mixing_norm, mixing_sigma,
            learnable=learnable_mixing, constrain=constrain_mixing,
            device=kwargs.get("device"), dtype=kwargs.get("dtype"))
        if self.grid_size is not None:
            self.layout(self.grid_size)  # built (and checked) once, outside any torch.compile graph

    def layout(self, grid: tuple[int, int], device: torch.device | None = None) -> BlockLayout:
        """The block layout of a ``gh x gw`` token grid on ``device`` (``mhla.blocks.block_layout``, cached)."""
        layout = block_layout(grid, self.block_grid, self.block_mode, self.num_prefix_tokens, device)
        if self.normalizer == "official" and not layout.evenly_divided:
            raise ValueError(
                f"normalizer='official' needs a token grid divisible by the block grid, got {grid[0]}x{grid[1]} "
                f"into {self.block_grid[0]}x{self.block_grid[1]}")
        return layout

    def full_mixing(self, layout: BlockLayout) -> torch.Tensor:
        """W ``[M + G, M + G]`` over the layout's patch and prefix blocks: ``[[W, 1], [1, 1]]`` (see the module doc)."""
        mixing = self.mixing()
        if layout.num_prefix_blocks:
            mixing = F.pad(mixing, (0, layout.num_prefix_blocks, 0, layout.num_prefix_blocks), value=1.0)
        return mixing

    def uses_parallel_form(self, layout: BlockLayout) -> bool:
        """Whether ``forward`` computes the N x N form for this layout (see ``form``)."""
        if self.form != "auto":
            return self.form == "parallel"
        if self.normalizer != "paper":
            return False
        num_tokens, slots = layout.num_tokens, layout.index.numel()
        num_blocks = layout.num_blocks + layout.num_prefix_blocks
        parallel_macs = 2 * num_tokens * num_tokens * self.head_dim
        block_macs = (2 * slots + num_blocks * num_blocks) * self.head_dim * self.head_dim
        return parallel_macs <= PARALLEL_ADVANTAGE * block_macs

    def _attend(self, qkv: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """The qkv projection's output ``[B, N, 3C]`` -> the attention output ``[B, N, C]``."""
        layout = self.layout(grid, qkv.device)
        mixing = self.full_mixing(layout)
        if self.normalizer == "official":  # through autograd: for loading the released code's checkpoints
            q, k, v = (layout.to_blocks(t) for t in self._features(qkv))  # [B, H, M, T, D]
            out = mhla_attention(q, k, v, mixing, normalizer="official", eps=self.eps)  # [B, H, M, T, D]
            out = layout.from_blocks(out.permute(0, 2, 3, 1, 4), dim=1).flatten(2)  # [B, N, C]
            if self.lepe is not None:  # no prefix tokens with this normalizer
                out = out + self.lepe(qkv[..., 2 * out.shape[-1]:], grid)  # from a view of v
            return out
        return self._qkv_attention(qkv.device)(qkv, self.num_heads, mixing=mixing, layout=layout,
                                               parallel=self.uses_parallel_form(layout), **self._fused_options())
