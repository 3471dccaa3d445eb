"""Checkpoint files written atomically: a crash mid-write never leaves a broken file behind."""
import os
import tempfile
from pathlib import Path

import torch

__all__ = ["save_atomic"]


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
