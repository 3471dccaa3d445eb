"""Weights from a file: read safely, unwrapped from any checkpoint layout, positions fitted to a model's grid.

The one place where a checkpoint file becomes a state dict, for ``validate.py`` and the analysis scripts
(``mhla.training.evaluation``), ``model.init_from`` (``mhla.training.finetune``), resuming
(``mhla.training.checkpoint``) and the converters (``models.convert``, ``scripts/convert_*.py``):

- ``read_checkpoint``: ``torch.load`` with ``weights_only=True`` (tensors and plain Python types), allowing one
  class more, ``argparse.Namespace``: the ``args`` that timm's ``CheckpointSaver`` (the training script of timm
  and of the paper's released code) stores in every ``model_best.pth.tar`` / ``last.pth.tar``.
- ``unwrap_state_dict``: the model (or EMA) weights of a checkpoint, ``module.`` / ``_orig_mod.`` prefixes
  (DistributedDataParallel, ``torch.compile``) removed by timm's ``clean_state_dict``:

  | written by | model weights | EMA weights |
  |---|---|---|
  | ``train.py`` here | ``model`` | ``ema`` (None without EMA) |
  | timm's ``train.py`` (the released code's) | ``state_dict`` | ``state_dict_ema`` |
  | DeiT's ``main.py`` and releases | ``model`` | ``model_ema`` |
  | ``scripts/convert_*.py``, ``torch.save(model.state_dict())`` | the top level | - |

- ``resample_pos_embed``: ``pos_embed`` on the model's token grid (timm's ``resample_abs_pos_embed``).
- ``WeightsError``: the one error for a weights file that is missing, unreadable or does not fit.

timm is imported where it is used: importing it loads wandb, YAML and torchvision's datasets, which
``import mhla`` does not.
"""
import argparse
import math
import pickle
import re
import warnings
from pathlib import Path

import torch
from torch import nn

__all__ = ["ALLOWED_GLOBALS", "WeightsError", "first_keys", "read_checkpoint", "resample_pos_embed",
           "unwrap_state_dict"]

ALLOWED_GLOBALS = (argparse.Namespace,)  # what timm's CheckpointSaver pickles beyond weights_only's default
WEIGHT_KEYS = ("state_dict", "model")  # timm's train.py; train.py here and DeiT
EMA_KEYS = ("state_dict_ema", "ema", "model_ema")  # timm's train.py; train.py here; DeiT
_NOT_ALLOWED = re.compile(r"Unsupported global: GLOBAL (\S+) was not an allowed global")
_UNPICKLER = "WeightsUnpickler error:"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WeightsError(ValueError):
    """A weights file that is missing or unreadable, or whose weights do not fit; one line naming what is wrong."""


def first_keys(keys: list[str], count: int = 3) -> str:
    """``a, b, c (+4 more)``: the first ``count`` of ``keys``, for an error message."""
    return ", ".join(keys[:count]) + (f" (+{len(keys) - count} more)" if len(keys) > count else "")


def _reason(error: Exception) -> str:
    """Why ``torch.load`` failed, in one plain line: no terminal escapes, no advice to unpickle the file."""
    text = _ANSI.sub("", str(error))
    not_allowed = _NOT_ALLOWED.search(text)
    if not_allowed:
        allowed = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in ALLOWED_GLOBALS)
        return (f"it holds a pickled object of type {not_allowed.group(1)} that is not allowed: a checkpoint holds "
                f"tensors, plain Python types and {allowed}")
    if isinstance(error, pickle.UnpicklingError):
        text = text.split(_UNPICKLER, 1)[1] if _UNPICKLER in text else "the weights-only unpickler refused it"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def read_checkpoint(path: str | Path) -> dict:
    """The content of a checkpoint file, read on the CPU with ``weights_only=True`` and ``ALLOWED_GLOBALS``.

    Raises:
        WeightsError: the file does not exist, cannot be read (truncated, not a PyTorch file, or a pickled
            object of another class, named), or holds something other than a dict; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"checkpoint {path} does not exist")
    try:
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)), warnings.catch_warnings():
            # torch warns of a pickle protocol it does not expect in a foreign file before refusing it: the error
            # below says it in one line
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, foreign or unsafe files all end here
        raise WeightsError(f"checkpoint {path} cannot be read ({_reason(e)})") from None
    if not isinstance(checkpoint, dict):
        raise WeightsError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a dict of weights")
    return checkpoint


def _is_state_dict(value: object) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def unwrap_state_dict(
        checkpoint: dict,
        use_ema: bool = False,
        path: str | Path | None = None,
        ema_option: str | None = "--ema",
) -> dict[str, torch.Tensor]:
    """The model weights of ``checkpoint`` (or its EMA weights), in any layout of the module's table.

    Args:
        checkpoint: what ``read_checkpoint`` returned.
        use_ema: take the EMA weights.
        path: the file, named in the errors.
        ema_option: how the caller's user asks for the EMA weights (a command-line flag), named in the errors;
            None where there is no such option.

    Returns:
        A new dict of the tensors (not copied), prefixes removed.

    Raises:
        WeightsError: no EMA weights when they are asked for; only EMA weights when they are not; no state
            dict of tensors where the layout puts it.
    """
    where = "the checkpoint" if path is None else f"checkpoint {path}"
    asked = f"{ema_option}: " if use_ema and ema_option else ""
    keys = EMA_KEYS if use_ema else WEIGHT_KEYS
    key = next((k for k in keys if isinstance(checkpoint.get(k), dict)), None)
    if key is None and use_ema:
        if _is_state_dict(checkpoint):
            raise WeightsError(f"{asked}{where} is a plain state dict without EMA weights")
        raise WeightsError(f"{asked}{where} holds no EMA weights (no {', '.join(map(repr, EMA_KEYS))}; trained "
                           f"without EMA?)")
    ema_only = None if key is not None else next((k for k in EMA_KEYS if isinstance(checkpoint.get(k), dict)), None)
    if ema_only is not None:
        reads = f": {ema_option} reads them" if ema_option else ""
        raise WeightsError(f"{where} holds only EMA weights ({ema_only!r}), no {' or '.join(map(repr, WEIGHT_KEYS))}"
                           f"{reads}")
    state = checkpoint if key is None else checkpoint[key]
    if not _is_state_dict(state):
        raise WeightsError(f"{asked}{where} holds no state dict of tensors (looked under "
                           f"{', '.join(map(repr, keys))} and at the top level)")
    from timm.models import clean_state_dict

    return clean_state_dict(state)


def resample_pos_embed(
        pos_embed: torch.Tensor,
        model: nn.Module,
        source_prefix_tokens: int | None = None,
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Absolute positions on a checkpoint's square grid -> ``model``'s prefix tokens and token grid.

    The patch positions are resampled by timm's ``resample_abs_pos_embed`` (bicubic) when the grids differ.
    The model keeps as many of the source's prefix positions as it embeds (none with ``no_embed_class``).
    Only shapes of ``model`` are read: a model on the ``meta`` device will do.

    Args:
        pos_embed: ``[1, P + s * s, C]``: ``P`` prefix (class, distillation) positions, then an ``s x s`` grid.
        model: a timm ``VisionTransformer`` (``patch_embed.grid_size``, ``num_prefix_tokens``).
        source_prefix_tokens: ``P``; None: as many as ``model`` embeds.

    Returns:
        The positions, ``[1, P' + gh * gw, C]`` for the model's ``P'`` and grid (``pos_embed`` itself when it
        fits already), and the source grid ``(s, s)``.

    Raises:
        WeightsError: the patch positions do not form a square grid.
    """
    from timm.layers import resample_abs_pos_embed

    keep = 0 if getattr(model, "no_embed_class", False) else getattr(model, "num_prefix_tokens", 0)
    prefix = keep if source_prefix_tokens is None else source_prefix_tokens
    patches = pos_embed.shape[1] - prefix
    side = math.isqrt(max(patches, 0))
    if side * side != patches:
        raise WeightsError(f"pos_embed: the checkpoint's {patches} patch positions are not a square grid")
    grid = list(model.patch_embed.grid_size)
    if grid == [side, side] and prefix == keep:
        return pos_embed, (side, side)
    resampled = resample_abs_pos_embed(pos_embed[:, prefix:], new_size=grid, old_size=[side, side],
                                       num_prefix_tokens=0)
    return torch.cat([pos_embed[:, :min(keep, prefix)], resampled], dim=1), (side, side)
