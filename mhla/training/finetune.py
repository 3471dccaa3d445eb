"""Initial weights for a fresh run (``model.init_from``): another run's model at another resolution or class count.

A fine-tuning run (DeiT-T MHLA from 224 to 384 px, say) starts from a checkpoint of the same model:

- ``pos_embed`` is resampled to the model's token grid when the grids differ (timm's
  ``resample_abs_pos_embed``, bicubic; prefix tokens, if the model embeds them, keep their positions);
- the classifier (``head`` and ``head_dist``) is dropped when the class count differs: it keeps the
  fresh model's initialisation;
- everything else must fit exactly: a missing or unexpected key, or a tensor of another shape, is a
  ``WeightsError`` naming the keys (and both shapes). MHLA's mixing matrix W is M x M for the
  *block* grid and does not depend on the token grid, so the same block grid at a higher resolution
  keeps W (the blocks hold more tokens); a W of another shape is an error.

The file is a ``train.py`` checkpoint (its ``model`` weights, not the EMA), a state dict written by
``scripts/convert_official.py``, or a timm/DeiT state dict: bare, or under ``model`` (DeiT's releases)
or ``state_dict`` (timm's training script), read by ``mhla.weights`` (``weights_only``).
"""
from pathlib import Path

import torch
from torch import nn

from ..weights import WeightsError, first_keys, read_checkpoint, resample_pos_embed, unwrap_state_dict

__all__ = ["fit_state_dict", "init_state_dict", "load_init_weights", "read_state_dict"]

CLASSIFIERS = ("head", "head_dist")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The model weights in ``path`` (``mhla.weights.read_checkpoint`` and ``unwrap_state_dict``).

    Raises:
        WeightsError: the file is missing or cannot be read, holds no state dict of tensors, or holds the
            released code's keys (convert them first); the message names the file.
    """
    state = unwrap_state_dict(read_checkpoint(path), path=path, ema_option=None)
    released = [k for k in state if k.endswith(".attn.to_qkv.weight")]
    if released:
        raise WeightsError(f"checkpoint {path} holds the released MHLA code's keys ({released[0]}); convert it "
                           f"first with scripts/convert_official.py")
    return state


def fit_state_dict(state: dict[str, torch.Tensor], model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` made to fit ``model``: positions resampled, a head of another class count dropped.

    Works on a model built on the ``meta`` device too (only shapes are read).

    Args:
        state: the checkpoint's weights (``read_state_dict``).
        model: the freshly built target, a timm ``VisionTransformer``.

    Returns:
        The weights to load with ``strict=False`` (only the dropped head's keys are absent) and notices,
        one line each, of what was resampled or dropped.

    Raises:
        WeightsError: unexpected or missing keys (named), or a tensor of another shape (the key and both
            shapes; for W, why its shape must match).
    """
    target = model.state_dict()
    notices, state = [], dict(state)
    source_classes = state["head.weight"].shape[0] if "head.weight" in state else 0
    model_classes = getattr(model, "num_classes", source_classes)
    head_keys = [k for k in target if k.split(".", 1)[0] in CLASSIFIERS]
    if source_classes != model_classes:
        dropped = [k for k in state if k.split(".", 1)[0] in CLASSIFIERS]
        for key in dropped:
            del state[key]
        what = f"{first_keys(dropped, 4)} dropped" if dropped else "no classifier in the checkpoint"
        notices.append(f"{what} (the checkpoint has {source_classes} classes, the model {model_classes}): "
                       f"the head starts from its fresh initialisation")
    else:
        head_keys = []
    unexpected = [k for k in state if k not in target]
    missing = [k for k in target if k not in state and k not in head_keys]
    if unexpected or missing:
        hint = ("; a timm DeiT with a class token converts with models.convert_softmax_deit"
                if {"cls_token", "dist_token"} & set(unexpected) else "")
        raise WeightsError(f"the weights do not fit the model: unexpected keys {first_keys(unexpected) or '-'}; "
                           f"missing keys {first_keys(missing) or '-'}{hint}")
    if "pos_embed" in state:
        state["pos_embed"], (side, _) = resample_pos_embed(state["pos_embed"], model)
        grid = tuple(model.patch_embed.grid_size)
        if grid != (side, side):
            notices.append(f"pos_embed resampled from {side}x{side} to {grid[0]}x{grid[1]} positions (bicubic)")
    wrong = [k for k, v in state.items() if v.shape != target[k].shape]
    if wrong:
        key = next((k for k in wrong if k.endswith("mixing.weight")), wrong[0])
        more = f" (+{len(wrong) - 1} more of another shape)" if len(wrong) > 1 else ""
        why = (": W is M x M for the block grid (model.kwargs.block_grid), whatever the image size; keep the "
               "checkpoint's block grid" if key.endswith("mixing.weight") else "")
        raise WeightsError(f"{key} has shape {tuple(state[key].shape)} in the checkpoint, "
                           f"{tuple(target[key].shape)} in the model{more}{why}")
    return state, notices


def init_state_dict(path: str | Path, model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``read_state_dict`` then ``fit_state_dict``; a ``meta`` model checks the file without loading it.

    Raises:
        WeightsError: a missing or unreadable file, or weights that do not fit; the message names the file, then
            the keys.
    """
    state = read_state_dict(path)
    try:
        return fit_state_dict(state, model)
    except WeightsError as e:
        raise WeightsError(f"checkpoint {path}: {e}") from None


def load_init_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Load the weights in ``path`` into the freshly built ``model`` (see the module's docstring).

    Args:
        model: the target, a timm ``VisionTransformer`` (on any device).
        path: a ``train.py`` checkpoint, a converted released-code state dict, or a timm/DeiT state dict.

    Returns:
        One-line notices: what was loaded, and what was resampled or dropped.

    Raises:
        WeightsError: a missing or unreadable file, or weights that do not fit (see ``fit_state_dict``).
    """
    state, notices = init_state_dict(path, model)
    total = len(model.state_dict())
    model.load_state_dict(state, strict=False)  # only a dropped head is absent: it keeps its initialisation
    return [f"{len(state)} of {total} tensors from {path}", *notices]
