"""mhla.benchmark: timing and peak-memory measurement."""
import subprocess
import sys

import pytest
from helpers import ROOT

from mhla.benchmark import time_call, time_interleaved

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


class FakeClock:
    """Seconds that pass only when a timed function says so: timings that no machine load can change."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def test_time_call_measures_the_time_the_call_takes():
    clock = FakeClock()
    timing = time_call(lambda: clock.spend(0.010), min_run_time=0.2, clock=clock)
    assert timing.runs >= 2 and timing.median_ms == pytest.approx(10.0) and timing.iqr_ms == pytest.approx(0.0)


def test_interleaved_rounds_give_the_median_and_the_spread():
    clock, state = FakeClock(), {"last": None, "round": -1}
    round_costs = [0.001, 0.010, 0.020, 0.030]  # "a": the warm-up, then rounds 1 to 3

    def a():
        if state["last"] != "a":  # the calls interleave: a, b, a, b, ...
            state["round"] += 1
        state["last"] = "a"
        clock.spend(round_costs[state["round"]])

    def b():
        state["last"] = "b"
        clock.spend(0.005)

    result = time_interleaved({"a": a, "b": b}, min_run_time=0.3, rounds=3, clock=clock)
    assert result["a"] == pytest.approx((20.0, 100.0))  # median of 10, 20, 30 ms; spread (30 - 10) / 20
    assert result["b"] == pytest.approx((5.0, 0.0))


@pytest.mark.slow  # a fresh process
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


@pytest.mark.slow  # a fresh process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim needs Linux")
def test_release_returns_the_memory_keep_freed_memory_kept():
    proc = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    kept_mib, released_mib = map(float, proc.stdout.split())
    assert kept_mib > 150  # freed, but kept by the process
    assert released_mib > 150  # handed back


def test_the_recompile_limits_a_benchmark_raises_are_restored_for_the_next_test(pytester):
    """``allow_compiled_variants`` under the ``restore_dynamo_limits`` fixture leaves dynamo's config readable and
    as it was for every later test, whatever pytest version undoes the fixture."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile("""
        import torch
        from mhla.benchmark import allow_compiled_variants

        BEFORE = (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit)

        def test_raises_them(restore_dynamo_limits):
            allow_compiled_variants(BEFORE[0] + 100)
            assert torch._dynamo.config.recompile_limit == BEFORE[0] + 100
            assert torch._dynamo.config.fail_on_recompile_limit_hit

        def test_reads_them_afterwards():
            assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit) == BEFORE
        """)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
