"""Which implementation an attention module runs: the torch path (``mhla.fused``) or the Triton kernels.

- ``"torch"``: ``mhla.fused.qkv_attention``, everywhere.
- ``"triton"``: ``mhla.kernels.qkv_attention``; it needs the ``triton`` package (PyTorch's CUDA builds bring
  it) and runs on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).
  Anything else is a one-line error.
- ``"auto"`` (the default): the torch path on the CPU and wherever ``triton`` does not import; on CUDA the
  kernels once they have passed the CUDA tests and the GPU report on a GPU (``TRITON_ON_CUDA_BY_DEFAULT``),
  the torch path until then.

The released code's normalizer (``normalizer="official"``, for loading its checkpoints) has the torch path only.
"""
import importlib.util
import os

import torch

__all__ = ["BACKENDS", "TRITON_ON_CUDA_BY_DEFAULT", "check_backend", "uses_triton"]

BACKENDS = ("auto", "torch", "triton")
# False until scripts/gpu_check.py has shown the kernels correct and faster on a GPU: no one trains by default on
# kernels that have never run on one.
TRITON_ON_CUDA_BY_DEFAULT = False


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_backend(backend: str) -> None:
    """A one-line ``ValueError`` for an unknown backend, or ``"triton"`` without the ``triton`` package."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "triton" and not _has_triton():
        raise ValueError("backend='triton' needs the triton package (PyTorch's CUDA builds bring it)")


def uses_triton(backend: str, device: torch.device) -> bool:
    """Whether a call on ``device`` runs the kernels (see the module's docstring).

    Raises:
        ValueError: ``backend="triton"`` on a device where the kernels cannot run.
    """
    if backend == "torch":
        return False
    if backend == "triton":
        if device.type != "cuda" and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError(f"backend='triton' runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1), "
                             f"got {device.type} tensors")
        return True
    return device.type == "cuda" and TRITON_ON_CUDA_BY_DEFAULT and _has_triton()
