"""MHLA: multi-head linear attention (token-level heads over spatial blocks) for vision transformers.

Besides the attention (``ops``, ``naive``, ``fused``, ``blocks``, ``mixing``, ``lepe``, ``norm``, ``attention``),
the library holds ``analysis``, ``flops`` and ``benchmark`` helpers and ``weights``, the one reader of weights
files (``import mhla.weights``: it uses timm, which ``import mhla`` does not load).
"""
from .attention import LinearAttention, MultiHeadLinearAttention
from .blocks import BlockLayout, block_layout
from .fused import qkv_attention
from .lepe import LePE
from .mixing import MixingMatrix, mixing_init
from .norm import RMSNorm, rms_norm
from .ops import linear_attention, mhla_attention, mhla_attention_parallel

__all__ = [
    "BlockLayout",
    "LePE",
    "LinearAttention",
    "MixingMatrix",
    "MultiHeadLinearAttention",
    "RMSNorm",
    "block_layout",
    "linear_attention",
    "mhla_attention",
    "mhla_attention_parallel",
    "mixing_init",
    "qkv_attention",
    "rms_norm",
]
