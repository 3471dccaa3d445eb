"""The performance targets: one table, read by the benchmark scripts, the GPU check and the docs.

Each target is a ratio of two measurements (a time, a throughput or a peak memory) and a bound on it, for one
kind of device: the CPU targets are what the benchmarks on this repository's 2-core CPU are held to (fp32), the
GPU targets are for one H200 in bf16 and, where the kernels exist, for the Triton kernels (``backend="triton"``;
no GPU has measured them yet). A script reads the table of the device it ran on (``for_device``); a ratio whose
target that table lacks is reported without one, or not at all. ``docs/benchmarks.md`` holds the table as
``markdown()`` renders it (tested).
"""
from dataclasses import dataclass

import torch

__all__ = ["DEVICES", "TARGETS", "Target", "device_kind", "for_device", "markdown"]

DEVICES = {"cpu": "CPU: the 2-core CPU machine of the recorded benchmarks, fp32",
           "gpu": "GPU: one NVIDIA H200, bf16"}


@dataclass(frozen=True)
class Target:
    """A bound on one measured ratio: ``ratio <op> value`` on devices of kind ``device`` ("cpu" or "gpu")."""

    name: str
    device: str
    op: str  # ">=" or "<="
    value: float
    description: str

    @property
    def goal(self) -> str:
        """The bound as the reports print it, e.g. ``">= 5"`` or ``"<= 0.333"``."""
        return f"{self.op} {self.value:.3g}"

    def met(self, ratio: float) -> bool:
        """Whether the measured ``ratio`` is within the bound (a NaN never is)."""
        return ratio >= self.value if self.op == ">=" else ratio <= self.value


def _target(name: str, op: str, description: str, **values: float) -> list[Target]:
    """One entry per device kind given in ``values`` (``cpu=``, ``gpu=``), sharing a name and description."""
    return [Target(name, device, op, value, description) for device, value in values.items()]


TARGETS: tuple[Target, ...] = (
    *_target("op.mhla_vs_linear", "<=", "the op: MHLA time / plain linear attention's, at each N and mode",
             cpu=1.25, gpu=1.3),
    *_target("op.speedup_4096", ">=", "the op at 4,096 tokens, forward + backward: SDPA time / MHLA time",
             cpu=20, gpu=8),
    *_target("op.speedup_16384", ">=", "the op at 16,384 tokens, forward + backward: SDPA time / MHLA time",
             gpu=25),
    *_target("op.mhla_vs_sdpa_196", "<=", "the op at 196 tokens (224 px): MHLA time / SDPA time, each mode",
             cpu=1.3),
    *_target("op.memory_growth", "<=", "the op's forward + backward: MHLA peak memory at 16,384 tokens / at 1,024",
             cpu=20),
    *_target("model.mhla_vs_linear", "<=",
             "`deit_*_mhla` / `deit_*_linear_lepe` step time (the cost of the blocks), each size and mode",
             cpu=1.15, gpu=1.15),
    *_target("model.speedup_1024", ">=", "`deit_*_softmax` / `deit_*_mhla` step time at 1024 px, each mode",
             cpu=4),
    *_target("model.train_vs_softmax_224", "<=", "`deit_*_mhla` / `deit_*_softmax` training-step time at 224 px",
             gpu=1.1),
    *_target("model.train_vs_softmax_1024", "<=", "`deit_*_mhla` / `deit_*_softmax` training-step time at 1024 px",
             gpu=0.7),
    *_target("model.throughput_vs_timm_224", ">=",
             "`deit_tiny_mhla` / timm's `deit_tiny_patch16_224` throughput at 224 px, each mode", cpu=0.95, gpu=0.9),
    *_target("model.memory_vs_softmax", "<=",
             "MHLA and linear attention / `deit_*_softmax` training peak memory, each size", cpu=1, gpu=1),
    *_target("model.mhla_memory_vs_softmax_1024", "<=",
             "`deit_*_mhla` / `deit_*_softmax` training peak memory at 1024 px (an older target: it holds only "
             "against softmax that stores the N x N matrix)", cpu=1 / 3),
)


def device_kind(device: str | torch.device) -> str:
    """The table a run on ``device`` reads: "gpu" on CUDA, "cpu" on any other device."""
    return "gpu" if torch.device(device).type == "cuda" else "cpu"


def for_device(device: str | torch.device) -> dict[str, Target]:
    """The targets of ``device``'s kind (``device_kind``), by name."""
    kind = device_kind(device)
    return {target.name: target for target in TARGETS if target.device == kind}


def markdown() -> str:
    """The table in Markdown, one table per device kind under its caption, as ``docs/benchmarks.md`` holds it."""
    parts = []
    for kind, caption in DEVICES.items():
        rows = [f"| `{t.name}` | {t.goal} | {t.description} |" for t in TARGETS if t.device == kind]
        parts.append("\n".join([f"{caption}:", "", "| target | goal | ratio |", "|---|---|---|", *rows]))
    return "\n\n".join(parts) + "\n"
