"""Multiply-accumulates of a model's forward pass, with timm's fused attention counted too."""
import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_macs"]


def count_macs(model: torch.nn.Module, input_size: tuple[int, ...]) -> int:
    """Multiply-accumulates of one forward of ``model`` on a ``[1, *input_size]`` input.

    Counted by ``torch.utils.flop_counter`` (matmuls, convolutions; not elementwise ops), whose
    FLOPs are two per multiply-accumulate. It has no formula for the CPU kernel of fused SDPA, so
    modules with timm's ``fused_attn`` switch run their explicit matmuls while counting.
    """
    param = next(model.parameters())
    x = torch.zeros(1, *input_size, device=param.device, dtype=param.dtype)
    fused = {m: m.fused_attn for m in model.modules() if getattr(m, "fused_attn", None) is True}
    counter = FlopCounterMode(display=False)
    try:
        for m in fused:
            m.fused_attn = False
        with counter, torch.no_grad():
            model(x)
    finally:
        for m, value in fused.items():
            m.fused_attn = value
    return counter.get_total_flops() // 2
