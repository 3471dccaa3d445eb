"""DeiT with MHLA, plain linear, or softmax attention, registered in timm.

Every model is timm's ``VisionTransformer`` (built by ``build_model_with_cfg``) with its attention
chosen by keyword (``attn_layer=``). The paper's DeiT setting: patch 16, head dim 64, no class
token, average pooling, 4 x 4 blocks (M = 16), RMSNorm on q and k, LePE 5 x 5, ``transform="linear"``,
learnable W kept in [0, 1]:

- ``deit_{tiny,small,base}_mhla``: ``MultiHeadLinearAttention`` (no qkv bias, as released).
- ``deit_{tiny,small,base}_mhla_official``: the released code's MHLA exactly (its inner LayerNorm,
  centred 224 -> 256 px padding, its normaliser, column-normalised W, q/k RMSNorm with the dtype's
  epsilon, no constraint on W), to load its checkpoints (``models.convert_official``).
- ``deit_{tiny,small}_linear``: the released code's linear baseline (what the paper's "linear
  attention" rows trained): ``LinearAttention`` with RMSNorm for every block norm and ``fc_norm``,
  fp32-style q/k RMSNorm (eps 1e-6), ``ReLU(x)`` with no offset, no LePE.
- ``deit_{tiny,small}_linear_lepe``: ``LinearAttention`` exactly like the MHLA models (LayerNorm
  blocks, LePE 5 x 5, ``ReLU(x) + eps``): MHLA with M = 1, the like-for-like comparison.
- ``deit_{tiny,small}_softmax``: timm's softmax ``Attention`` (DeiT's qkv bias), no class token.

Every attention option is a ``create_model`` keyword (``block_grid``, ``transform``, ``lepe_kernel``,
``normalizer``, ``learnable_mixing``, ``input_norm``, ...), as are timm's own (``class_token``,
``img_size``, ``dynamic_img_size``, ``norm_layer``, ...). ``img_pad_to=256`` zero-pads input images to
256 px, centred (16 px on every side of a 224 px image), as the released code does: the padding then
becomes real tokens (patch-embedding bias and position embedding) that take part in attention, LePE
and pooling, and the 16 x 16 token grid splits evenly into 4 x 4 blocks.
"""
import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import register_notrace_module, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from mhla import LinearAttention, MultiHeadLinearAttention, RMSNorm

__all__ = ["ATTENTION_OPTIONS", "MhlaVisionTransformer"]

ATTENTION_TYPES = ("mhla", "linear", "softmax")
LINEAR_OPTIONS = ("lepe_kernel", "eps", "feature_eps", "norm_eps", "input_norm", "backend")
MHLA_OPTIONS = ("block_grid", "block_mode", "transform", "mixing_norm", "mixing_sigma", "learnable_mixing",
                "constrain_mixing", "normalizer", "form")
ATTENTION_OPTIONS = LINEAR_OPTIONS + MHLA_OPTIONS

# torch.fx traces around the linear attentions (their token grid and block layout depend on shapes)
# and the RMSNorm (a custom autograd function), as timm's feature extraction and its FX tests expect.
register_notrace_module(LinearAttention)
register_notrace_module(MultiHeadLinearAttention)
register_notrace_module(RMSNorm)

# The sizes timm divides by or allocates with, and the least value of each; a smaller one would fail
# deep inside timm (a division by zero, a tensor of negative size) rather than name the keyword.
SIZE_MINIMUMS = {"embed_dim": 1, "num_heads": 1, "patch_size": 1, "depth": 0, "reg_tokens": 0}


def _check_sizes(kwargs: dict) -> None:
    """``ValueError`` naming the keyword of ``kwargs`` whose size is not an integer of at least its minimum."""
    for name, minimum in SIZE_MINIMUMS.items():
        if name not in kwargs:
            continue
        values = to_2tuple(kwargs[name]) if name == "patch_size" else (kwargs[name],)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
            raise ValueError(f"{name} must be an integer >= {minimum}, got {kwargs[name]!r}")


def _configured(attn_cls: type, **options) -> type:
    """A stand-in for ``attn_cls`` whose constructor defaults to ``options``.

    timm's ``Block`` builds ``attn_layer(dim, num_heads=..., ...)`` itself and needs a class, so the
    model's attention options are bound into one. Constructing it returns a plain ``attn_cls``
    instance, so the model holds, prints and pickles only ``attn_cls`` modules.
    """

    def __new__(cls, *args, **kwargs):
        return attn_cls(*args, **{**options, **kwargs})

    return type(attn_cls.__name__, (), {"__new__": __new__, "__doc__": f"{attn_cls.__name__} with {options}"})


@torch.fx.wrap  # torch.fx records the call as one node: its padding depends on the input's shape
def pad_centred(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad images ``[B, C, H, W]`` to ``size x size``, centred (the released code's padding)."""
    pad_h, pad_w = size - x.shape[-2], size - x.shape[-1]
    if pad_h < 0 or pad_w < 0:
        raise ValueError(f"input {tuple(x.shape[-2:])} is larger than img_pad_to={size}")
    return F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))


class MhlaVisionTransformer(VisionTransformer):
    """timm's ``VisionTransformer`` with the attention chosen by ``attn_type``.

    Args:
        attn_type: ``"mhla"``, ``"linear"`` or ``"softmax"``.
        img_pad_to: zero-pad input images to this size, centred (as the released code), before patch
            embedding; ``img_size`` is then this size too. None (default) uses the image as is.
        **kwargs: the attention options of ``ATTENTION_OPTIONS`` (linear and MHLA only) and
            timm ``VisionTransformer`` arguments.

    Raises:
        ValueError: a bad argument (an option the attention type lacks, a size below ``SIZE_MINIMUMS``,
            an image size the patch size does not divide, ...), named in the message.
    """

    def __init__(self, attn_type: str = "mhla", img_pad_to: int | None = None, **kwargs) -> None:
        if attn_type not in ATTENTION_TYPES:
            raise ValueError(f"unknown attn_type {attn_type!r}; expected one of {ATTENTION_TYPES}")
        options = {name: kwargs.pop(name) for name in ATTENTION_OPTIONS if name in kwargs}
        allowed = {"mhla": ATTENTION_OPTIONS, "linear": LINEAR_OPTIONS, "softmax": ()}[attn_type]
        for name in options:
            if name not in allowed:
                raise ValueError(f"{name}={options[name]!r} is not an option of attn_type={attn_type!r}")
        _check_sizes(kwargs)
        if img_pad_to is not None:
            kwargs["img_size"] = img_pad_to
        img_size = to_2tuple(kwargs.get("img_size", 224))
        patch_size = to_2tuple(kwargs.get("patch_size", 16))
        if not kwargs.get("dynamic_img_pad") and (img_size[0] % patch_size[0] or img_size[1] % patch_size[1]):
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        if attn_type != "softmax":
            grid = (img_size[0] // patch_size[0], img_size[1] // patch_size[1])
            num_prefix = int(kwargs.get("class_token", True)) + kwargs.get("reg_tokens", 0)
            attn_cls = MultiHeadLinearAttention if attn_type == "mhla" else LinearAttention
            kwargs["attn_layer"] = _configured(attn_cls, grid_size=grid, num_prefix_tokens=num_prefix, **options)
        super().__init__(**kwargs)
        self.attn_type = attn_type
        self.img_pad_to = img_pad_to

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """timm's set plus every mixing matrix W.

        Weight decay shrinks all of W alike, which leaves MHLA's output unchanged (numerator and
        denominator scale together) while pushing the denominator towards eps: it has no use on W.
        """
        names = {f"{name}.weight" for name, module in self.named_modules() if name.endswith("attn.mixing")}
        return super().no_weight_decay() | names

    def _pad_image(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.img_pad_to is None else pad_centred(x, self.img_pad_to)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """Tell every linear attention layer the token grid of this batch, then add positions."""
        grid = tuple(x.shape[1:3]) if self.dynamic_img_size else tuple(self.patch_embed.grid_size)
        if self.attn_type != "softmax":
            for block in self.blocks:
                block.attn.grid_size = grid
        return super()._pos_embed(x)

    def forward_features(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return super().forward_features(self._pad_image(x), *args, **kwargs)

    def forward_intermediates(self, x: torch.Tensor, *args, **kwargs):
        return super().forward_intermediates(self._pad_image(x), *args, **kwargs)


def _cfg(url: str = "", **kwargs) -> dict:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        "paper_ids": "arXiv:2601.07832",
        "paper_name": "MHLA: Restoring Expressivity of Linear Attention via Token-Level Multi-Head",
        **kwargs,
    }


VARIANTS = [("tiny", "mhla"), ("small", "mhla"), ("base", "mhla"), ("tiny", "mhla_official"),
            ("small", "mhla_official"), ("base", "mhla_official"), ("tiny", "linear"), ("small", "linear"),
            ("tiny", "linear_lepe"), ("small", "linear_lepe"), ("tiny", "softmax"), ("small", "softmax")]
default_cfgs = generate_default_cfgs({f"deit_{size}_{kind}.untrained": _cfg() for size, kind in VARIANTS})

_SIZES = {"tiny": dict(embed_dim=192, num_heads=3), "small": dict(embed_dim=384, num_heads=6),
          "base": dict(embed_dim=768, num_heads=12)}
_MHLA = dict(attn_type="mhla", qkv_bias=False, qk_norm=True, block_grid=(4, 4), transform="linear", lepe_kernel=5)
_ATTENTION = {
    "mhla": _MHLA,
    "mhla_official": dict(_MHLA, normalizer="official", mixing_norm="columns", input_norm=True, norm_eps=None,
                          constrain_mixing=False, img_pad_to=256),
    "linear": dict(attn_type="linear", qkv_bias=False, qk_norm=True, lepe_kernel=0, feature_eps=0.0,
                   norm_layer=RMSNorm),
    "linear_lepe": dict(attn_type="linear", qkv_bias=False, qk_norm=True, lepe_kernel=5),
    "softmax": dict(attn_type="softmax", qkv_bias=True),
}


def _create(variant: str, pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    size, kind = variant.split("_", 2)[1:]
    model_args = dict(patch_size=16, depth=12, class_token=False, global_pool="avg", **_SIZES[size],
                      **_ATTENTION[kind])
    return build_model_with_cfg(
        MhlaVisionTransformer, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=3, feature_cls="getter"),
        **dict(model_args, **kwargs),
    )


@register_model
def deit_tiny_mhla(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Tiny (192 wide, 3 heads of 64) with MHLA, 4 x 4 blocks."""
    return _create("deit_tiny_mhla", pretrained, **kwargs)


@register_model
def deit_small_mhla(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Small (384 wide, 6 heads of 64) with MHLA, 4 x 4 blocks."""
    return _create("deit_small_mhla", pretrained, **kwargs)


@register_model
def deit_base_mhla(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Base (768 wide, 12 heads of 64) with MHLA, 4 x 4 blocks."""
    return _create("deit_base_mhla", pretrained, **kwargs)


@register_model
def deit_tiny_mhla_official(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Tiny MHLA exactly as the released code builds it (its ``deit_tiny_pla_1d_v6_6``)."""
    return _create("deit_tiny_mhla_official", pretrained, **kwargs)


@register_model
def deit_small_mhla_official(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Small MHLA exactly as the released code builds it (its ``deit_small_pla_1d_v6_6``)."""
    return _create("deit_small_mhla_official", pretrained, **kwargs)


@register_model
def deit_base_mhla_official(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Base MHLA exactly as the released code builds it (its ``deit_base_pla_1d_v6_6``)."""
    return _create("deit_base_mhla_official", pretrained, **kwargs)


@register_model
def deit_tiny_linear(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Tiny with the released code's linear baseline (RMSNorm blocks, ReLU, no LePE), at DeiT-T width."""
    return _create("deit_tiny_linear", pretrained, **kwargs)


@register_model
def deit_small_linear(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Small with the released code's linear baseline (its ``deit_small_linear``)."""
    return _create("deit_small_linear", pretrained, **kwargs)


@register_model
def deit_tiny_linear_lepe(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Tiny with ReLU linear attention built like the MHLA model (LayerNorm blocks, RMSNorm q/k, LePE)."""
    return _create("deit_tiny_linear_lepe", pretrained, **kwargs)


@register_model
def deit_small_linear_lepe(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Small with ReLU linear attention built like the MHLA model (LayerNorm blocks, RMSNorm q/k, LePE)."""
    return _create("deit_small_linear_lepe", pretrained, **kwargs)


@register_model
def deit_tiny_softmax(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Tiny with softmax attention, no class token and average pooling like the MHLA models."""
    return _create("deit_tiny_softmax", pretrained, **kwargs)


@register_model
def deit_small_softmax(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Small with softmax attention, no class token and average pooling like the MHLA models."""
    return _create("deit_small_softmax", pretrained, **kwargs)
