"""timm model registrations: ``import models`` makes ``timm.create_model("deit_tiny_mhla")`` work."""
from .convert import convert_official, convert_softmax_deit
from .deit_mhla import ATTENTION_OPTIONS, MhlaVisionTransformer

__all__ = ["ATTENTION_OPTIONS", "MhlaVisionTransformer", "convert_official", "convert_softmax_deit"]
