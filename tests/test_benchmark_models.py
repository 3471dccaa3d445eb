"""scripts/benchmark.py: a smoke run on tiny settings and its argument checks."""
import csv
import json
import subprocess
import sys

import pytest
import timm
import torch
from helpers import ROOT, TARGET_DEVICES, load_script

import models  # noqa: F401  (registers the models)
from mhla import targets as goals
from mhla.flops import count_macs

SCRIPT = ROOT / "scripts" / "benchmark.py"


@pytest.mark.slow  # the script in a subprocess
def test_smoke_run_writes_every_output(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--models", "deit_tiny_mhla", "deit_tiny_linear_lepe", "--img-sizes", "64",
           "--batch-size", "2", "--min-run-time", "0.05", "--rounds", "2", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["model"], r["img_size"], r["mode"]) for r in rows} == {
        (model, "64", mode) for model in ("deit_tiny_mhla", "deit_tiny_linear_lepe") for mode in ("inference", "train")}
    for row in rows:
        assert float(row["img_per_s"]) == float(row["batch_size"]) * 1e3 / float(row["step_ms"])
        assert float(row["gmacs"]) > 0 and 5.0 < float(row["params_m"]) < 6.0
        assert float(row["spread_pct"]) >= 0
    train = next(r for r in rows if r["mode"] == "train")
    assert float(train["peak_mib"]) > 0  # activations and gradients of a training step
    for row in rows:  # the attention keeps its input, qkv and the projection's input, and MHLA its 16 x 16 mixing
        assert 5.0 <= float(row["attn_kept_c"]) < 5.1 and float(row["kept_mib"]) > 0
    assert "| deit_tiny_mhla | 64 |" in proc.stdout
    report = json.loads((tmp_path / "benchmark.json").read_text())
    step = {(r["model"], r["mode"]): float(r["step_ms"]) for r in rows}
    assert [(r["ratio"], r["mode"]) for r in report["ratios"]] == [
        ("deit_tiny_mhla / deit_tiny_linear_lepe step time", mode) for mode in ("inference", "train")]
    for r in report["ratios"]:
        mode = r["mode"]
        assert r["value"] == pytest.approx(step[("deit_tiny_mhla", mode)] / step[("deit_tiny_linear_lepe", mode)])
        goal = goals.for_device("cuda" if torch.cuda.is_available() else "cpu")["model.mhla_vs_linear"].goal
        assert f"| {r['ratio']} | 64 | {mode} | {r['value']:.2f} | {goal} |" in proc.stdout
    assert (tmp_path / "throughput.png").stat().st_size > 0


@pytest.mark.parametrize("device", TARGET_DEVICES)
def test_ratios_have_the_targets_of_the_devices_table(device):
    """Each ratio beside its entry of ``mhla.targets`` for ``device``: MHLA's memory at 1024 px against its own
    entry where the table has one, else the one of every size; the speed-up has a target at 1024 px only."""
    def row(model, size, mode, step_ms, peak_mib=100.0):
        return dict(model=model, img_size=size, mode=mode, step_ms=step_ms, img_per_s=8e3 / step_ms, peak_mib=peak_mib)

    rows = [row("deit_tiny_patch16_224", 224, "inference", 100.0), row("deit_tiny_mhla", 224, "inference", 108.0),
            row("deit_tiny_softmax", 224, "inference", 90.0), row("deit_tiny_mhla", 224, "train", 108.0),
            row("deit_tiny_softmax", 224, "train", 100.0),
            row("deit_tiny_mhla", 1024, "train", 10.0, peak_mib=300.0),
            row("deit_tiny_softmax", 1024, "train", 35.0, peak_mib=1000.0),
            row("deit_tiny_linear_lepe", 1024, "train", 9.0)]
    table = goals.for_device(device)
    memory_1024 = next(name for name in ("model.mhla_memory_vs_softmax_1024", "model.memory_vs_softmax")
                       if name in table)
    speed_up = "deit_tiny_softmax / deit_tiny_mhla step time (speed-up)"
    expected = {
        ("deit_tiny_mhla / deit_tiny_patch16_224 throughput", 224, "inference"):
            (100 / 108, "model.throughput_vs_timm_224"),
        (speed_up, 224, "inference"): (90 / 108, None),
        (speed_up, 224, "train"): (100 / 108, None),
        (speed_up, 1024, "train"): (3.5, "model.speedup_1024"),
        ("deit_tiny_mhla / deit_tiny_softmax training-step time", 224, "train"): (1.08, "model.train_vs_softmax_224"),
        ("deit_tiny_mhla / deit_tiny_softmax training-step time", 1024, "train"):
            (10 / 35, "model.train_vs_softmax_1024"),
        ("deit_tiny_mhla / deit_tiny_softmax peak memory", 224, "train"): (1.0, "model.memory_vs_softmax"),
        ("deit_tiny_mhla / deit_tiny_softmax peak memory", 1024, "train"): (0.3, memory_1024),
        ("deit_tiny_mhla / deit_tiny_linear_lepe step time", 1024, "train"): (10 / 9, "model.mhla_vs_linear"),
        ("deit_tiny_linear_lepe / deit_tiny_softmax peak memory", 1024, "train"): (0.1, "model.memory_vs_softmax"),
    }
    found = {(r["ratio"], r["img_size"], r["mode"]): r for r in load_script("benchmark").ratios(rows, device)}
    assert set(found) == set(expected)
    for key, (value, name) in expected.items():
        assert found[key]["value"] == pytest.approx(value), key
        if name not in table:  # e.g. the speed-up's GPU bound is the training-step ratio's
            assert (found[key]["target"], found[key]["met"]) == (None, None)
        else:
            target = table[name]
            met = value >= target.value if target.op == ">=" else value <= target.value
            assert (found[key]["target"], found[key]["met"]) == (target.goal, met), key


def test_bad_arguments(tmp_path, capsys):
    for args, message in ((["--models", "deit_tiny_nope"], "unknown model 'deit_tiny_nope'"),
                          (["--img-sizes", "100"], "100 is not divisible by the patch size 16"),
                          (["--compile", "regional"], "argument --compile: invalid choice: 'regional'")):
        with pytest.raises(SystemExit) as exc:
            load_script("benchmark").main([*args, "--out-dir", str(tmp_path)])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _fake_measurements(script, monkeypatch, peak=None):
    """Calls that compute nothing, fixed times and kept memory; memory workers refused; ``peak``: call -> bytes."""
    calls = []

    def build_call(name, size, mode, args):
        calls.append(lambda: None)
        calls[-1].key = (name, mode)
        return calls[-1]

    def memory_worker(*args):
        raise AssertionError("started a memory worker")

    monkeypatch.setattr(script.bench, "keep_freed_memory", lambda: True)  # leave this process's allocator alone
    monkeypatch.setattr(script, "build_call", build_call)
    monkeypatch.setattr(script.bench, "time_interleaved",
                        lambda calls, min_run_time, rounds: {key: (10.0, 1.0) for key in calls})
    monkeypatch.setattr(script, "measure_kept", lambda args, name, size: (1.0, 5.0))
    monkeypatch.setattr(script, "measure_memory", memory_worker)
    if peak is not None:
        monkeypatch.setattr(script.bench, "peak_memory", lambda call, device: peak(call, device))
    return calls


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_no_memory_runs_no_memory_worker_and_leaves_the_memory_ratios_out(tmp_path, monkeypatch,
                                                                          restore_dynamo_limits):
    """``--no-memory``: NaN peaks, no memory measured at all."""
    script = load_script("benchmark")
    _fake_measurements(script, monkeypatch, peak=lambda call, device: pytest.fail("measured a peak"))
    assert script.main(["--models", "deit_tiny_softmax", "deit_tiny_mhla", "--img-sizes", "64", "--no-memory",
                        "--no-plot", "--out-dir", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "benchmark.csv")
    assert len(rows) == 4 and all(row["peak_mib"] == "nan" for row in rows)
    ratios = json.loads((tmp_path / "benchmark.json").read_text())["ratios"]
    assert [r["ratio"] for r in ratios] == ["deit_tiny_softmax / deit_tiny_mhla step time (speed-up)"] * 2 + [
        "deit_tiny_mhla / deit_tiny_softmax training-step time"]


def test_on_cuda_the_timed_calls_give_the_peak_memory_in_process(tmp_path, monkeypatch, restore_dynamo_limits):
    """On CUDA no fresh process: the very calls that were timed (a compiled model is not compiled again) are
    measured, each once, in this process; the CSV is written after each resolution."""
    script = load_script("benchmark")
    measured = []

    def peak(call, device):
        measured.append(call)
        assert device == torch.device("cuda")
        return {"inference": 1, "train": 3}[call.key[1]] * 2 ** 20 * (2 if call.key[0] == "deit_tiny_mhla" else 1)

    calls = _fake_measurements(script, monkeypatch, peak)
    written = []
    monkeypatch.setattr(script.bench, "write_csv", lambda rows, path: written.append(len(rows)))
    assert script.main(["--models", "deit_tiny_softmax", "deit_tiny_mhla", "--img-sizes", "64", "96",
                        "--device", "cuda", "--compile", "blocks", "--no-plot", "--out-dir", str(tmp_path)]) == 0
    assert measured == calls and len(calls) == 8  # 2 models x 2 modes x 2 sizes, each call built and measured once
    assert written == [4, 8]
    assert torch._dynamo.config.recompile_limit >= 8 and torch._dynamo.config.fail_on_recompile_limit_hit
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [(r["model"], r["img_size"], r["mode"], r["peak_mib"], r["compile"]) for r in rows[:4]] == [
        ("deit_tiny_softmax", 64, "inference", 1.0, "blocks"), ("deit_tiny_softmax", 64, "train", 3.0, "blocks"),
        ("deit_tiny_mhla", 64, "inference", 2.0, "blocks"), ("deit_tiny_mhla", 64, "train", 6.0, "blocks")]
    memory = [r for r in json.loads((tmp_path / "benchmark.json").read_text())["ratios"] if "memory" in r["ratio"]]
    assert [(r["img_size"], r["value"]) for r in memory] == [(64, 2.0), (96, 2.0)]


def test_the_compile_flag(tmp_path):
    script = load_script("benchmark")
    assert [script.parse_args(argv).compile for argv in ([], ["--compile"], ["--compile", "blocks"],
                                                         ["--compile", "--no-memory"])] == [
        "none", "model", "blocks", "model"]


def test_macs_and_parameters_are_counted_on_the_meta_device():
    script = load_script("benchmark")
    model = timm.create_model("deit_tiny_mhla", img_size=64).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    assert script.model_size("deit_tiny_mhla", 64) == (params, count_macs(model, (3, 64, 64)) / 1e9)


def test_backend_runs_our_linear_models_on_the_kernels_and_each_row_names_it(tmp_path, monkeypatch, capsys):
    """``--backend triton``: our MHLA and linear-attention models are built on the kernels, timm's and the softmax
    models as they are; the CSV's ``backend`` says which, and without the interpreter the CPU refuses it."""
    script = load_script("benchmark")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        script.parse_args(["--backend", "triton", "--device", "cpu"])
    assert exc.value.code == 2 and "--backend: backend='triton' runs on CUDA tensors" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = script.parse_args(["--backend", "triton", "--device", "cpu"])
    mhla = script.create("deit_tiny_mhla", 64, args)
    assert {block.attn.backend for block in mhla.blocks} == {"triton"}
    assert script.create("deit_tiny_linear_lepe", 64, args).blocks[0].attn.backend == "triton"
    assert not script.takes_backend("deit_tiny_softmax") and not script.takes_backend("deit_tiny_patch16_224")
    script.create("deit_tiny_softmax", 64, args)  # no backend keyword: it would raise
    _fake_measurements(script, monkeypatch)
    assert script.main(["--models", "deit_tiny_softmax", "deit_tiny_mhla", "--img-sizes", "64", "--backend",
                        "triton", "--device", "cpu", "--no-memory", "--no-plot", "--out-dir", str(tmp_path)]) == 0
    assert {(r["model"], r["backend"]) for r in _rows(tmp_path / "benchmark.csv")} == {
        ("deit_tiny_softmax", ""), ("deit_tiny_mhla", "triton")}
    assert "backend triton (linear attention and MHLA)" in (tmp_path / "benchmark.md").read_text()
    assert script.main(["--models", "deit_tiny_mhla", "--img-sizes", "64", "--no-memory", "--no-plot",
                        "--out-dir", str(tmp_path)]) == 0
    assert {r["backend"] for r in _rows(tmp_path / "benchmark.csv")} == {"torch"}  # auto on the CPU
