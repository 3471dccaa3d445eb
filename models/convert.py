"""Convert checkpoints of other codebases into state dicts for the registered models.

``convert_official``: a checkpoint of the paper's released code (DAGroup-PKU/MHLA,
``mhla_image_classification``, written by its timm training script) into the matching
``deit_*_mhla_official`` or ``deit_*_linear`` model, key for key, nothing initialised.

``convert_softmax_deit``: a timm softmax DeiT into a starting point for fine-tuning an MHLA (or
linear/softmax, no class token) model. ``deit_tiny_patch16_224``'s layout has a class token,
``pos_embed`` ``[1, 1 + N, C]`` and ``norm`` before the head. Fine-tuning MHLA from it keeps everything
the two share and initialises the rest:

- the class (and distillation) token and their positions are dropped (unless the target has a
  class token, which then keeps the source's), the patch positions are resampled to the target grid;
- the final ``norm`` moves to ``fc_norm`` when the target pools by average (timm puts the norm after
  pooling there);
- tensors whose shape or presence differs (``qkv.bias`` for a target without qkv bias, a head of
  another class count, ``head_dist``) are dropped;
- MHLA-only parameters (mixing W, LePE, q/k RMSNorm) keep the target model's initialisation.
"""
import re

import torch
from torch import nn

from mhla.weights import first_keys, resample_pos_embed, unwrap_state_dict

__all__ = ["OFFICIAL_ATTENTION_KEYS", "convert_official", "convert_softmax_deit"]

# The released attention's parameters (below ``blocks.N.attn.``) and ours; every other key has the same name.
OFFICIAL_ATTENTION_KEYS = {
    "to_qkv.weight": "qkv.weight",
    "to_out.0.weight": "proj.weight",
    "to_out.0.bias": "proj.bias",
    "norm.weight": "input_norm.weight",
    "norm.bias": "input_norm.bias",
    "q_norm.weight": "q_norm.weight",
    "k_norm.weight": "k_norm.weight",
    "lepe.weight": "lepe.conv.weight",
    "lepe.bias": "lepe.conv.bias",
    "piece_attn.conv.weight": "mixing.weight",
}
# What a timm softmax ``Attention`` holds (below ``blocks.N.attn.``).
SOFTMAX_ATTENTION_KEYS = {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "q_norm.weight", "q_norm.bias",
                          "k_norm.weight", "k_norm.bias"}
_ATTN = re.compile(r"^(blocks\.\d+\.attn\.)(.+)$")


def convert_official(
        checkpoint: dict,
        model: nn.Module,
        use_ema: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """Map a released-code checkpoint onto ``model`` (``deit_*_mhla_official`` or ``deit_*_linear``).

    Every source tensor must have a place and every target tensor a source: the result loads into
    ``model`` with ``strict=True`` and reproduces the released model's logits. W (``piece_attn.conv``,
    a 1 x 1 convolution ``[M, M, 1, 1]``) becomes ``mixing.weight`` ``[M, M]`` (row i: query block i).

    Args:
        checkpoint: what the released timm training script saved (``state_dict``, ``state_dict_ema``),
            a dict holding the weights under ``model``, or a bare state dict (``mhla.weights.unwrap_state_dict``).
        model: the target, built with the released model's sizes.
        use_ema: take the EMA weights (``state_dict_ema``).

    Returns:
        The state dict and a report: ``mixing_out_of_range``, ``(key, min, max)`` of every W with
        entries outside [0, 1] (the released training clamps W only without AMP); a model that
        constrains W (``constrain_mixing=True``) would clamp them, ``deit_*_mhla_official`` keeps them.

    Raises:
        ValueError: not a released-code checkpoint (e.g. a timm softmax DeiT), keys that have no place
            in ``model`` or that ``model`` lacks, or shapes that differ; the message names them. Weights that
            are not where ``use_ema`` says are a ``mhla.weights.WeightsError`` (a ``ValueError``).
    """
    state = unwrap_state_dict(checkpoint, use_ema)
    if not any(_ATTN.match(k) and _ATTN.match(k).group(2) == "to_qkv.weight" for k in state):
        raise ValueError("not a checkpoint of the released MHLA code: no 'blocks.N.attn.to_qkv.weight' "
                         "(a timm softmax DeiT converts with convert_softmax_deit)")
    target = model.state_dict()
    out, unknown = {}, []
    for name, value in state.items():
        match = _ATTN.match(name)
        if match:
            if match.group(2) not in OFFICIAL_ATTENTION_KEYS:
                unknown.append(name)
                continue
            name = match.group(1) + OFFICIAL_ATTENTION_KEYS[match.group(2)]
            if name.endswith("mixing.weight"):
                value = value.flatten(1)  # [M, M, 1, 1] -> [M, M]
        out[name] = value
    if unknown:
        raise ValueError(f"{len(unknown)} keys of the released attention are not known: {first_keys(unknown)}")
    unexpected = [k for k in out if k not in target]
    missing = [k for k in target if k not in out]
    if unexpected or missing:
        raise ValueError(f"the checkpoint does not fit {type(model).__name__}: {len(unexpected)} keys without a "
                         f"place ({first_keys(unexpected) or '-'}), {len(missing)} missing "
                         f"({first_keys(missing) or '-'})")
    for name, value in out.items():
        if value.shape != target[name].shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, the model expects {tuple(target[name].shape)}")
    report = {"mixing_out_of_range": [(k, v.min().item(), v.max().item()) for k, v in out.items()
                                      if k.endswith("mixing.weight") and (v.min() < 0 or v.max() > 1)]}
    return out, report


def convert_softmax_deit(
        state_dict: dict[str, torch.Tensor],
        model: nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Map ``state_dict`` onto ``model``'s keys and shapes.

    Args:
        state_dict: a timm DeiT/ViT state dict, or a checkpoint holding it (``state_dict`` as timm's
            training script saves it, or ``model``).
        model: the target, e.g. ``timm.create_model("deit_tiny_mhla")``.

    Returns:
        A complete state dict for ``model`` (loads with ``strict=True``) and a report with the
        source keys ``copied`` and ``dropped`` and the target keys ``initialised`` from ``model``.
    """
    state_dict = unwrap_state_dict(state_dict, ema_option=None)
    if "pos_embed" not in state_dict or "patch_embed.proj.weight" not in state_dict:
        raise ValueError("not a ViT/DeiT state dict: 'pos_embed' or 'patch_embed.proj.weight' is missing")
    foreign = [k for k in state_dict if _ATTN.match(k) and _ATTN.match(k).group(2) not in SOFTMAX_ATTENTION_KEYS]
    if foreign:
        raise ValueError(f"not a softmax DeiT: {len(foreign)} attention keys of another kind ({first_keys(foreign)}); "
                         f"a checkpoint of the released MHLA code converts with convert_official")
    target = model.state_dict()
    source_prefix = sum(name in state_dict for name in ("cls_token", "dist_token"))
    out, report = {}, {"copied": [], "dropped": [], "initialised": []}
    for name, value in state_dict.items():
        dest = name
        if name == "pos_embed":
            value, _ = resample_pos_embed(value, model, source_prefix)
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

