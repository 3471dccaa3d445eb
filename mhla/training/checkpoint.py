"""Training checkpoints: written atomically, read back to resume, with every RNG state for exact resume.

A checkpoint holds plain types only (tensors, numbers, strings, lists, dicts), so it loads with
``weights_only=True`` (``mhla.weights.read_checkpoint``) without unpickling arbitrary objects.
"""
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..weights import WeightsError, read_checkpoint

__all__ = ["RESUME_KEYS", "get_rng_state", "load_checkpoint", "save_atomic", "set_rng_state"]

RESUME_KEYS = ("model", "optimizer", "scheduler", "scaler", "ema", "state", "rng")  # what resuming restores


def save_atomic(obj: object, path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | os.PathLike) -> dict:
    """A ``train.py`` checkpoint to resume from, read by ``mhla.weights.read_checkpoint``.

    Raises:
        WeightsError: the file is missing or unreadable, or lacks an entry of ``RESUME_KEYS`` (weights alone
            start a fresh run with ``model.init_from``); the message names the file.
    """
    checkpoint = read_checkpoint(path)
    missing = [key for key in RESUME_KEYS if key not in checkpoint]
    if missing:
        raise WeightsError(f"checkpoint {path} is not a train.py checkpoint to resume from: no "
                           f"{', '.join(map(repr, missing))} (weights alone start a fresh run with model.init_from)")
    return checkpoint


def get_rng_state() -> dict:
    """The python, numpy, torch (and CUDA) generator states, as plain types."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``get_rng_state`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
