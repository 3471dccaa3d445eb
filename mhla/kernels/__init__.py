"""Triton kernels for linear attention and MHLA (fla's layout: one file per form, beside the torch path).

Each kernel takes what ``mhla.fused.qkv_attention`` takes, the qkv projection's output, and maps q and k
on load (``features``); its naive reference is ``mhla.naive.naive_qkv_attention``. Importing this package
needs ``triton``; on the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which the
tests use.
"""
from .attention import qkv_attention

__all__ = ["qkv_attention"]
