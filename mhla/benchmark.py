"""Timing, peak-memory and plotting helpers shared by the benchmark scripts.

Times are medians of ``torch.utils.benchmark.Timer.blocked_autorange`` (which synchronises CUDA).
Peak memory is the largest amount of memory a call needs beyond what was in use before it:
``torch.cuda.max_memory_allocated`` on CUDA; on the CPU, the growth of the resident set during the
call (Linux: the peak counter is reset just before it), measured after ``return_freed_memory()`` so
that resident memory follows the live tensors; ``peak_memory_in_worker`` takes each figure in a
fresh process, so that no measurement inherits another's memory.
"""
import csv
import ctypes
import ctypes.util
import resource
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["METHOD_LABELS", "Timing", "allow_compiled_variants", "keep_freed_memory", "peak_memory",
           "peak_memory_in_worker", "plot_log_log", "release_freed_memory", "return_freed_memory", "saved_bytes",
           "time_call", "time_interleaved", "write_csv"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# The op benchmark's methods (scripts/benchmark_attention.py) as the targets' names in its report and the GPU check's.
METHOD_LABELS = {"sdpa": "SDPA", "sdpa_flash": "SDPA (FlashAttention)", "sdpa_cudnn": "SDPA (cuDNN)",
                 "linear": "linear", "mhla": "MHLA", "linear_triton": "linear (Triton)", "mhla_triton": "MHLA (Triton)"}


@dataclass(frozen=True)
class Timing:
    median_ms: float
    iqr_ms: float
    runs: int


def time_call(fn: Callable[[], object], min_run_time: float = 1.0,
              clock: Callable[[], float] = timeit.default_timer) -> Timing:
    """Median and interquartile range of ``fn()`` over at least ``min_run_time`` seconds, on all torch threads.

    ``clock`` reads the time in seconds (the tests give a clock that only ``fn`` advances).
    """
    from torch.utils.benchmark import Timer  # imported here: it loads torch.utils.cpp_extension, which warns

    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), timer=clock)
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(measurement.median * 1e3, measurement.iqr * 1e3, len(measurement.times))


def time_interleaved(calls: dict[Hashable, Callable[[], object]], min_run_time: float, rounds: int,
                     clock: Callable[[], float] = timeit.default_timer) -> dict[Hashable, tuple[float, float]]:
    """Median time (ms) and spread (max - min over the rounds, % of the median) of every call.

    The calls are timed in interleaved rounds, so that a slow spell of a noisy machine hits them
    alike; each round takes ``min_run_time / rounds`` seconds per call and gives a median, and the
    result is the median of the rounds. Each call runs once first (warm-up), and the memory freed
    by a call is handed back before the next (``release_freed_memory``), so that no call inherits
    another's fragments.
    """
    for call in calls.values():
        call()
        release_freed_memory()
    times: dict[Hashable, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            times[key].append(time_call(call, min_run_time / rounds, clock).median_ms)
            release_freed_memory()
    return {key: (statistics.median(values), 100 * (max(values) - min(values)) / statistics.median(values))
            for key, values in times.items()}


def allow_compiled_variants(count: int) -> None:
    """Let ``torch.compile`` keep ``count`` compiled variants of one function, and raise past that.

    A benchmark compiles the same code once per model, mode (grad or not) and size: the blocks' or the
    model's forward, or the op. Past dynamo's ``recompile_limit`` (8) it would run the rest eagerly
    with only a warning, and the "compiled" figures would be eager ones.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, count)
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = (),
                within: torch.nn.Module | None = None) -> int:
    """Bytes of the tensors autograd keeps for backward while ``fn()`` runs: what a training forward holds.

    Counted by storage (a view of a kept tensor costs nothing more), from
    ``torch.autograd.graph.saved_tensors_hooks``; storages of ``exclude`` (e.g. the parameters, which
    exist anyway) are left out. With ``within``, only what is kept while that module's forward runs.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}
    active = [within is None]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if active[0] and storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    handles = [] if within is None else [
        within.register_forward_pre_hook(lambda *_: active.__setitem__(0, True)),
        within.register_forward_hook(lambda *_: active.__setitem__(0, False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn()
    finally:
        for handle in handles:
            handle.remove()
    return sum(kept.values())


def peak_memory_in_worker(cmd: list[str], what: str) -> float:
    """Run ``cmd``, a fresh process that prints its peak memory (MiB) on its last line, and return it.

    Raises ``RuntimeError`` naming ``what`` with the end of the worker's stderr when it fails.
    """
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def write_csv(rows: list[dict], path: Path) -> None:
    """``rows`` (dicts with the same keys) as a CSV file; the scripts call it after each size, so that what is
    measured so far survives a later size's failure."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot_log_log(rows: list[dict], *, x: str, y: str, series: str, panel: str, panels: dict[str, str], path: Path,
                 xlabel: str, ylabel: str, sharey: bool = False) -> None:
    """One log-log panel per value of ``rows[i][panel]`` (``panels``: value -> title), one line per series."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=sharey, squeeze=False)
    for ax, (value, title) in zip(axes[0], panels.items(), strict=True):
        for name in dict.fromkeys(r[series] for r in rows):
            points = sorted((r[x], r[y]) for r in rows if r[series] == name and r[panel] == value)
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel=xlabel, title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].set_ylabel(ylabel)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident set size to its current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes ``fn()`` needs on top of the memory in use before it (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if _reset_peak_rss() and (base := _proc_status_bytes("VmRSS")) is not None:
        fn()
        return max(0, _proc_status_bytes("VmHWM") - base)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * (1 if sys.platform == "darwin" else 1024)


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (Linux), else None."""
    path = ctypes.util.find_library("c")
    return ctypes.CDLL(path) if sys.platform.startswith("linux") and path is not None else None


def _mallopt(threshold: int, trim: int) -> bool:
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold) and
                                     libc.mallopt(_M_TRIM_THRESHOLD, trim))


def release_freed_memory() -> bool:
    """Hand the memory glibc keeps after ``keep_freed_memory`` back to the OS now (``malloc_trim``).

    Call it between measurements of different models: each then reuses its own freed memory, and
    the process does not pile up the fragments of every model's large steps (at 1024 px that ran a
    24 GiB machine out of memory). Returns False where glibc is not available.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def return_freed_memory() -> bool:
    """Make glibc map every allocation over 64 KiB on its own and unmap it when freed.

    Resident memory then follows the live tensors, which is what ``peak_memory`` reads on the CPU.
    Returns False where glibc is not available.
    """
    return _mallopt(64 * 1024, 64 * 1024)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the process instead of returning it to the OS.

    PyTorch has no caching allocator on the CPU, so every large temporary is a fresh ``mmap`` whose
    pages fault in on first touch; on a small VM that can cost more than the arithmetic and makes
    timings of memory-hungry ops erratic. Keeping freed memory (as the CUDA caching allocator,
    jemalloc or tcmalloc do) removes that noise. Returns False where glibc is not available.
    """
    return _mallopt(32 * 1024 * 1024, 2 ** 31 - 1)
