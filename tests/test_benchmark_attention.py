"""scripts/benchmark_attention.py: a smoke run on tiny settings, the target arithmetic, bad sizes."""
import csv
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TARGET_DEVICES, load_script

from mhla import targets as goals

benchmark_attention = load_script("benchmark_attention")


@pytest.mark.slow  # the script in a subprocess
def test_smoke_run_writes_table_csv_and_plot(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_attention.py"), "--sizes", "64",
           "--methods", "linear", "mhla", "--batch-size", "1", "--heads", "1", "--head-dim", "8",
           "--block-grid", "2", "2", "--min-run-time", "0.02", "--rounds", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| N | linear fwd ms | mhla fwd ms |" in proc.stdout
    assert "MHLA / linear time, N=64, train" in proc.stdout
    with open(tmp_path / "attention_benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["method"], r["n"], r["mode"]) for r in rows} == {
        (m, "64", mode) for m in ("linear", "mhla") for mode in ("forward", "train")}
    assert all(float(r["time_ms"]) > 0 and float(r["peak_mib"]) >= 0 for r in rows)
    assert (tmp_path / "attention_benchmark.png").stat().st_size > 0
    assert (tmp_path / "attention_benchmark.md").read_text().count("\n|") >= 4


@pytest.mark.parametrize("device", TARGET_DEVICES)
def test_the_targets_are_those_of_the_devices_table(device):
    """Each ratio against its entry of ``mhla.targets`` for ``device``; a ratio whose entry that table lacks is
    not listed."""
    def row(method, n, mode, time_ms, peak_mib=1.0):
        return dict(method=method, n=n, mode=mode, time_ms=time_ms, peak_mib=peak_mib)

    rows = [row("linear", 196, "forward", 1.0), row("mhla", 196, "forward", 1.2), row("sdpa", 196, "forward", 0.5),
            row("sdpa", 4096, "train", 100.0), row("mhla", 4096, "train", 10.0),
            row("mhla", 1024, "train", 1.0, peak_mib=10.0), row("mhla", 16384, "train", 20.0, peak_mib=250.0),
            row("linear_triton", 4096, "train", 2.0), row("mhla_triton", 4096, "train", 2.4),
            row("sdpa_flash", 4096, "train", 90.0), row("sdpa", 16384, "train", 1000.0),
            row("mhla_triton", 16384, "train", 30.0)]
    expected = {"MHLA / linear time, N=196, forward": ("op.mhla_vs_linear", 1.2),
                "SDPA / MHLA time, N=4096, train": ("op.speedup_4096", 10.0),
                "MHLA / SDPA time, N=196, forward": ("op.mhla_vs_sdpa_196", 2.4),
                "MHLA peak memory N=16384 / N=1024, train": ("op.memory_growth", 25.0),
                "MHLA (Triton) / linear (Triton) time, N=4096, train": ("op.mhla_vs_linear", 1.2),
                "SDPA / MHLA (Triton) time, N=4096, train": ("op.speedup_4096", 100 / 2.4),
                "SDPA (FlashAttention) / MHLA (Triton) time, N=4096, train": ("op.speedup_4096", 90 / 2.4),
                "SDPA (FlashAttention) / MHLA time, N=4096, train": ("op.speedup_4096", 9.0),
                "SDPA / MHLA time, N=16384, train": ("op.speedup_16384", 50.0),
                "SDPA / MHLA (Triton) time, N=16384, train": ("op.speedup_16384", 1000 / 30)}
    table = goals.for_device(device)
    found = {name: (value, goal, met) for name, value, goal, met in benchmark_attention.targets(rows, device)}
    assert set(found) == {name for name, (key, _) in expected.items() if key in table}
    for name, (value, goal, met) in found.items():
        target = table[expected[name][0]]
        assert value == pytest.approx(expected[name][1]) and goal == target.goal
        assert met == (value >= target.value if target.op == ">=" else value <= target.value)


def test_non_square_size_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        benchmark_attention.parse_args(["--sizes", "200"])
    assert exc.value.code == 2
    assert "200 is not a square number of tokens" in capsys.readouterr().err


def test_compile_compiles_each_op_once_for_every_size_and_mode(tmp_path, monkeypatch, restore_dynamo_limits):
    """``--compile``: one ``torch.compile`` per op (static shapes), shared by every N and mode, and room for
    all their graphs (past dynamo's limit it would run them eagerly); the timed calls go through it."""
    from mhla import linear_attention, mhla_attention

    compiled, calls = [], []

    def fake_compile(fn, dynamic=None):
        compiled.append((fn, dynamic))

        def run(*args, **kwargs):
            calls.append(fn)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(benchmark_attention, "measure_memory", lambda args, method, n, mode: 1.0)
    monkeypatch.setattr(benchmark_attention.bench, "keep_freed_memory", lambda: True)
    benchmark_attention.op.cache_clear()
    try:
        benchmark_attention.main(["--sizes", "16", "64", "--methods", "linear", "mhla", "--batch-size", "1",
                                  "--heads", "1", "--head-dim", "8", "--block-grid", "2", "2", "--min-run-time",
                                  "0.01", "--rounds", "1", "--compile", "--no-plot", "--out-dir", str(tmp_path)])
    finally:
        benchmark_attention.op.cache_clear()
    assert compiled == [(linear_attention, False), (mhla_attention, False)]
    assert set(calls) == {linear_attention, mhla_attention}
    assert torch._dynamo.config.recompile_limit >= 6 and torch._dynamo.config.fail_on_recompile_limit_hit
    assert "cpu, float32, compiled," in (tmp_path / "attention_benchmark.md").read_text()


def test_on_cuda_the_timed_calls_give_the_peak_memory_in_process(tmp_path, monkeypatch):
    built, measured = [], []

    def build_call(method, n, mode, args):
        built.append(lambda: None)
        built[-1].key = (method, n, mode)
        return built[-1]

    def peak(call, device):
        measured.append(call)
        assert device == torch.device("cuda")
        return call.key[1] * 2 ** 20

    def memory_worker(*args):
        raise AssertionError("started a memory worker")

    monkeypatch.setattr(benchmark_attention, "build_call", build_call)
    monkeypatch.setattr(benchmark_attention.bench, "time_interleaved",
                        lambda calls, min_run_time, rounds: {key: (1.0, 0.0) for key in calls})
    monkeypatch.setattr(benchmark_attention.bench, "peak_memory", peak)
    monkeypatch.setattr(benchmark_attention.bench, "keep_freed_memory", lambda: True)
    monkeypatch.setattr(benchmark_attention, "measure_memory", memory_worker)
    benchmark_attention.main(["--sizes", "16", "64", "--methods", "linear", "mhla", "--device", "cuda",
                              "--no-plot", "--out-dir", str(tmp_path)])
    assert measured == built and len(built) == 8
    with open(tmp_path / "attention_benchmark.csv") as f:
        assert {(r["method"], r["n"], r["mode"], r["peak_mib"]) for r in csv.DictReader(f)} == {
            (m, str(n), mode, f"{float(n)}")
            for m in ("linear", "mhla") for n in (16, 64) for mode in ("forward", "train")}


def test_pinned_sdpa_is_refused_off_cuda_and_the_kernels_without_the_interpreter(capsys, monkeypatch):
    for argv, message in ((["--methods", "sdpa", "sdpa_flash", "sdpa_cudnn", "--device", "cpu"],
                           "--methods: sdpa_flash, sdpa_cudnn pin a CUDA backend of SDPA; --device is cpu"),
                          (["--methods", "mhla_triton", "--device", "cpu"],
                           "--methods: backend='triton' runs on CUDA tensors (or on CPU tensors under "
                           "TRITON_INTERPRET=1), got cpu tensors")):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(SystemExit) as exc:
            benchmark_attention.parse_args(argv)
        err = capsys.readouterr().err.splitlines()
        assert exc.value.code == 2 and err[-1].endswith(f"error: {message}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert benchmark_attention.parse_args(["--methods", "mhla_triton", "--device", "cpu"]).methods == ["mhla_triton"]
    assert benchmark_attention.parse_args(["--methods", "sdpa_cudnn", "--device", "cuda"]).methods == ["sdpa_cudnn"]


def test_the_kernels_are_timed_beside_the_torch_path_and_land_in_the_csv(tmp_path, monkeypatch):
    """Under Triton's interpreter, tiny sizes: both kernels are timed forward and forward + backward beside the torch
    path, and their calls give a ``[B, N, C]`` output (the kernels' own tests hold its values and gradients)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(benchmark_attention, "measure_memory", lambda args, method, n, mode: 1.0)
    monkeypatch.setattr(benchmark_attention.bench, "keep_freed_memory", lambda: True)
    argv = ["--sizes", "16", "--methods", "linear", "linear_triton", "mhla_tokens", "mhla_triton", "--batch-size",
            "1", "--heads", "2", "--head-dim", "16", "--block-grid", "2", "2", "--min-run-time", "0.01", "--rounds",
            "1", "--no-plot", "--out-dir", str(tmp_path)]
    benchmark_attention.main(argv)
    with open(tmp_path / "attention_benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["method"], r["mode"]) for r in rows} == {
        (m, mode) for m in ("linear", "linear_triton", "mhla_tokens", "mhla_triton") for mode in ("forward", "train")}
    assert all(float(r["time_ms"]) > 0 for r in rows)
    args = benchmark_attention.parse_args(argv)
    for method in ("linear_triton", "mhla_triton"):
        out = benchmark_attention.build_call(method, 16, "forward", args)()
        assert out.shape == (1, 16, 32) and torch.isfinite(out).all()
        benchmark_attention.build_call(method, 16, "train", args)()  # forward + backward runs
