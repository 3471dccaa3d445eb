"""Checkpoints: written atomically, read with ``weights_only=True``, with every RNG state for exact resume.

A checkpoint holds plain types only (tensors, numbers, strings, lists, dicts), so it loads without
unpickling arbitrary objects.
"""
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["CheckpointError", "get_rng_state", "load_checkpoint", "save_atomic", "set_rng_state"]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or cannot be read; the message names the file."""


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
    """Read a checkpoint (``weights_only=True``) or raise ``CheckpointError`` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, foreign or unsafe files all end here
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise CheckpointError(f"checkpoint {path} cannot be read ({reason})") from None


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
