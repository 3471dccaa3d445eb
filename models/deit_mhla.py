"""DeiT with MHLA, plain linear, or softmax attention, registered in timm.

Every model is timm's ``VisionTransformer`` (built by ``build_model_with_cfg``) with its attention
chosen by keyword (``attn_layer=``). The paper's DeiT setting: patch 16, head dim 64, no class
token, average pooling, 4 x 4 blocks (M = 16), RMSNorm on q and k, LePE 5 x 5, ``transform="linear"``,
learnable W kept in [0, 1]. The three families differ only in the attention, so they train under
identical settings:

- ``deit_{tiny,small,base}_mhla``: ``MultiHeadLinearAttention`` (no qkv bias, as released).
- ``deit_{tiny,small}_linear``: ``LinearAttention`` with the same RMSNorm and LePE (M = 1).
- ``deit_{tiny,small}_softmax``: timm's softmax ``Attention`` (DeiT's qkv bias), no class token.

Every attention option is a ``create_model`` keyword (``block_grid``, ``transform``, ``lepe_kernel``,
``normalizer``, ``learnable_mixing``, ...), as are timm's own (``class_token``, ``img_size``,
``dynamic_img_size``, ...). ``img_pad_to=256`` reproduces the released code's zero padding of
224 px images to 256 px (bottom and right), which gives a 16 x 16 token grid.
"""
import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import register_notrace_module, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from mhla import LinearAttention, MultiHeadLinearAttention

__all__ = ["ATTENTION_OPTIONS", "MhlaVisionTransformer"]

ATTENTION_TYPES = ("mhla", "linear", "softmax")
LINEAR_OPTIONS = ("lepe_kernel", "eps", "norm_eps")
MHLA_OPTIONS = ("block_grid", "block_mode", "transform", "mixing_norm", "mixing_sigma", "learnable_mixing",
                "constrain_mixing", "normalizer", "form")
ATTENTION_OPTIONS = LINEAR_OPTIONS + MHLA_OPTIONS

# torch.fx traces around the linear attentions (their token grid and block layout depend on shapes),
# as timm's feature extraction and its FX tests expect of such layers.
register_notrace_module(LinearAttention)
register_notrace_module(MultiHeadLinearAttention)


def _configured(attn_cls: type, **options) -> type:
    """A stand-in for ``attn_cls`` whose constructor defaults to ``options``.

    timm's ``Block`` builds ``attn_layer(dim, num_heads=..., ...)`` itself and needs a class, so the
    model's attention options are bound into one. Constructing it returns a plain ``attn_cls``
    instance, so the model holds, prints and pickles only ``attn_cls`` modules.
    """

    def __new__(cls, *args, **kwargs):
        return attn_cls(*args, **{**options, **kwargs})

    return type(attn_cls.__name__, (), {"__new__": __new__, "__doc__": f"{attn_cls.__name__} with {options}"})


class MhlaVisionTransformer(VisionTransformer):
    """timm's ``VisionTransformer`` with the attention chosen by ``attn_type``.

    Args:
        attn_type: ``"mhla"``, ``"linear"`` or ``"softmax"``.
        img_pad_to: zero-pad input images (bottom/right) to this size before patch embedding;
            ``img_size`` is then this size too. None (default) uses the image as is.
        **kwargs: the attention options of ``ATTENTION_OPTIONS`` (linear and MHLA only) and
            timm ``VisionTransformer`` arguments.
    """

    def __init__(self, attn_type: str = "mhla", img_pad_to: int | None = None, **kwargs) -> None:
        if attn_type not in ATTENTION_TYPES:
            raise ValueError(f"unknown attn_type {attn_type!r}; expected one of {ATTENTION_TYPES}")
        options = {name: kwargs.pop(name) for name in ATTENTION_OPTIONS if name in kwargs}
        allowed = {"mhla": ATTENTION_OPTIONS, "linear": LINEAR_OPTIONS, "softmax": ()}[attn_type]
        for name in options:
            if name not in allowed:
                raise ValueError(f"{name}={options[name]!r} is not an option of attn_type={attn_type!r}")
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
        if self.img_pad_to is None:
            return x
        pad_h, pad_w = self.img_pad_to - x.shape[-2], self.img_pad_to - x.shape[-1]
        if pad_h < 0 or pad_w < 0:
            raise ValueError(f"input {tuple(x.shape[-2:])} is larger than img_pad_to={self.img_pad_to}")
        return F.pad(x, (0, pad_w, 0, pad_h))

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


default_cfgs = generate_default_cfgs({
    f"deit_{size}_{kind}.untrained": _cfg()
    for size, kind in [("tiny", "mhla"), ("small", "mhla"), ("base", "mhla"), ("tiny", "linear"),
                       ("small", "linear"), ("tiny", "softmax"), ("small", "softmax")]
})

_SIZES = {"tiny": dict(embed_dim=192, num_heads=3), "small": dict(embed_dim=384, num_heads=6),
          "base": dict(embed_dim=768, num_heads=12)}
_ATTENTION = {
    "mhla": dict(attn_type="mhla", qkv_bias=False, qk_norm=True, block_grid=(4, 4), transform="linear",
                 lepe_kernel=5),
    "linear": dict(attn_type="linear", qkv_bias=False, qk_norm=True, lepe_kernel=5),
    "softmax": dict(attn_type="softmax", qkv_bias=True),
}


def _create(variant: str, pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    size, kind = variant.split("_")[1:3]
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
def deit_tiny_linear(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Tiny with plain ReLU linear attention (RMSNorm q/k, LePE), the paper's baseline."""
    return _create("deit_tiny_linear", pretrained, **kwargs)


@register_model
def deit_small_linear(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Small with plain ReLU linear attention (RMSNorm q/k, LePE), the paper's baseline."""
    return _create("deit_small_linear", pretrained, **kwargs)


@register_model
def deit_tiny_softmax(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Tiny with softmax attention, no class token and average pooling like the MHLA models."""
    return _create("deit_tiny_softmax", pretrained, **kwargs)


@register_model
def deit_small_softmax(pretrained: bool = False, **kwargs) -> MhlaVisionTransformer:
    """DeiT-Small with softmax attention, no class token and average pooling like the MHLA models."""
    return _create("deit_small_softmax", pretrained, **kwargs)
