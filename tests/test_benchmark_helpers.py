"""mhla.benchmark: timing and peak-memory measurement."""
import subprocess
import sys
import time

import pytest

from mhla.benchmark import time_call

PEAK_SCRIPT = """
import torch
from mhla.benchmark import peak_memory, return_freed_memory
assert return_freed_memory()
keep = torch.ones(16 * 2**20 // 4)  # allocated before: not part of the peak
def fn():
    a = torch.ones(48 * 2**20 // 4)  # 48 MiB
    b = a + 1                        # 48 MiB more while a lives
    del a
    return b.sum()
print(peak_memory(fn, torch.device("cpu")) / 2**20)
"""


def test_time_call_measures_a_known_duration():
    timing = time_call(lambda: time.sleep(0.01), min_run_time=0.2)
    assert timing.runs >= 2
    assert 9.5 <= timing.median_ms <= 40


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident-memory peak needs Linux")
def test_cpu_peak_memory_counts_what_the_call_allocates():
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    peak_mib = float(proc.stdout.strip().splitlines()[-1])
    assert 95 <= peak_mib <= 105


RELEASE_SCRIPT = """
import torch
from mhla.benchmark import keep_freed_memory, release_freed_memory

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

assert keep_freed_memory()
before = rss_mib()
chunks = [torch.ones(2**20 // 4) for _ in range(200)]  # 200 x 1 MiB, below the mmap threshold: heap
del chunks
kept = rss_mib()
assert release_freed_memory()
print(kept - before, kept - rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim needs Linux")
def test_release_returns_the_memory_keep_freed_memory_kept():
    proc = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    kept_mib, released_mib = map(float, proc.stdout.split())
    assert kept_mib > 150  # freed, but kept by the process
    assert released_mib > 150  # handed back
