"""Convert a timm softmax DeiT state dict into one for an MHLA (or linear/softmax, no class token) model.

``deit_tiny_patch16_224``'s layout: class token, ``pos_embed`` ``[1, 1 + N, C]``, ``norm`` before the
head. Fine-tuning MHLA from it keeps everything the two share and initialises the rest:

- the class (and distillation) token and their positions are dropped (unless the target has a
  class token, which then keeps the source's), the patch positions are resampled to the target grid;
- the final ``norm`` moves to ``fc_norm`` when the target pools by average (timm puts the norm after
  pooling there);
- tensors whose shape or presence differs (``qkv.bias`` for a target without qkv bias, a head of
  another class count, ``head_dist``) are dropped;
- MHLA-only parameters (mixing W, LePE, q/k RMSNorm) keep the target model's initialisation.
"""
import math

import torch
from timm.layers import resample_abs_pos_embed
from torch import nn

__all__ = ["convert_softmax_deit"]


def convert_softmax_deit(
        state_dict: dict[str, torch.Tensor],
        model: nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Map ``state_dict`` onto ``model``'s keys and shapes.

    Args:
        state_dict: a timm DeiT/ViT state dict (or a checkpoint dict holding it under ``"model"``).
        model: the target, e.g. ``timm.create_model("deit_tiny_mhla")``.

    Returns:
        A complete state dict for ``model`` (loads with ``strict=True``) and a report with the
        source keys ``copied`` and ``dropped`` and the target keys ``initialised`` from ``model``.
    """
    state_dict = state_dict.get("model", state_dict)
    if "pos_embed" not in state_dict or "patch_embed.proj.weight" not in state_dict:
        raise ValueError("not a ViT/DeiT state dict: 'pos_embed' or 'patch_embed.proj.weight' is missing")
    target = model.state_dict()
    source_prefix = sum(name in state_dict for name in ("cls_token", "dist_token"))
    out, report = {}, {"copied": [], "dropped": [], "initialised": []}
    for name, value in state_dict.items():
        dest = name
        if name == "pos_embed":
            value = _resample_positions(value, source_prefix, model)
        elif name.startswith("norm.") and name not in target and "fc_" + name in target:
            dest = "fc_" + name
        if dest in target and target[dest].shape == value.shape:
            out[dest] = value
            report["copied"].append(name)
        else:
            report["dropped"].append(name)
    for name, value in target.items():
        if name not in out:
            out[name] = value
            report["initialised"].append(name)
    return out, report


def _resample_positions(pos_embed: torch.Tensor, source_prefix: int, model: nn.Module) -> torch.Tensor:
    """``[1, P + gh * gw, C]`` source positions -> the target's prefix and grid."""
    patches = pos_embed[:, source_prefix:]
    side = math.isqrt(patches.shape[1])
    if side * side != patches.shape[1]:
        raise ValueError(f"pos_embed has {patches.shape[1]} patch positions, not a square grid")
    patches = resample_abs_pos_embed(patches, new_size=list(model.patch_embed.grid_size), old_size=[side, side],
                                     num_prefix_tokens=0)
    keep_prefix = 0 if getattr(model, "no_embed_class", False) else getattr(model, "num_prefix_tokens", 0)
    return torch.cat([pos_embed[:, :min(keep_prefix, source_prefix)], patches], dim=1)
