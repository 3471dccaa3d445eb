"""Timing and peak-memory helpers shared by the benchmark scripts.

Times are medians of ``torch.utils.benchmark.Timer.blocked_autorange`` (which synchronises CUDA).
Peak memory is the largest amount of memory a call needs beyond what was in use before it:
``torch.cuda.max_memory_allocated`` on CUDA; on the CPU, the growth of the resident set during the
call (Linux: the peak counter is reset just before it), measured after ``return_freed_memory()`` so
that resident memory follows the live tensors.
"""
import ctypes
import ctypes.util
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Timing", "keep_freed_memory", "peak_memory", "return_freed_memory", "time_call"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@dataclass(frozen=True)
class Timing:
    median_ms: float
    iqr_ms: float
    runs: int


def time_call(fn: Callable[[], object], min_run_time: float = 1.0) -> Timing:
    """Median and interquartile range of ``fn()`` over at least ``min_run_time`` seconds, on all torch threads."""
    from torch.utils.benchmark import Timer  # imported here: it loads torch.utils.cpp_extension, which warns

    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(measurement.median * 1e3, measurement.iqr * 1e3, len(measurement.times))


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
