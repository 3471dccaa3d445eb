"""Count what one training step dispatches: non-view aten ops plus Triton launches, per model and resolution.

    python scripts/launch_count.py                      # DeiT-T softmax, linear and MHLA, torch path and kernels
    python scripts/launch_count.py --img-sizes 224 1024

On a GPU each op and each launch is at least one kernel launch, which for a DeiT-T at 224 px costs more than
its arithmetic. The count does not depend on the values, so on the CPU the kernels run under Triton's
interpreter with their launches counted and skipped: the step takes seconds, not the interpreter's minutes.
Prints a Markdown table (forward + backward of a batch of 2, no optimizer step).
"""
import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels on CPU tensors

import timm  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import models  # noqa: E402, F401  (registers the models)

RUNS = [("deit_tiny_softmax", "torch"), ("deit_tiny_linear_lepe", "torch"), ("deit_tiny_linear_lepe", "triton"),
        ("deit_tiny_mhla", "torch"), ("deit_tiny_mhla", "triton")]


class _Dispatched(TorchDispatchMode):
    """Counts the aten ops that are not views (ops whose outputs alias an input without writing to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            self.count += 1
        return func(*args, **(kwargs or {}))


def dispatched(name: str, backend: str, img_size: int = 224) -> tuple[int, int]:
    """Non-view aten ops and Triton launches of one forward + backward of ``name`` (batch 2, on the CPU).

    ``backend`` "torch" or "triton" for the linear attentions; softmax models take none.
    """
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: launches.append(self)
    try:
        kwargs = {} if "softmax" in name else {"backend": backend}
        model = timm.create_model(name, img_size=img_size, **kwargs)
        x = torch.zeros(2, 3, img_size, img_size)
        with _Dispatched() as mode:
            model(x).sum().backward()
    finally:
        InterpretedFunction.run = run
    return mode.count, len(launches)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--img-sizes", type=int, nargs="+", default=[224, 1024])
    args = parser.parse_args(argv)
    print("| model | backend | px | aten ops | Triton launches | total | / softmax |")
    print("|---|---|---|---|---|---|---|")
    for size in args.img_sizes:
        softmax = None
        for name, backend in RUNS:
            ops, launches = dispatched(name, backend, size)
            softmax = softmax or ops + launches
            shown = "-" if "softmax" in name else backend
            print(f"| {name} | {shown} | {size} | {ops} | {launches} | {ops + launches} | "
                  f"{(ops + launches) / softmax:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
