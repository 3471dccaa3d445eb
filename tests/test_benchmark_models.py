"""scripts/benchmark.py: a smoke run on tiny settings and its argument checks."""
import csv
import subprocess
import sys

from helpers import ROOT

SCRIPT = ROOT / "scripts" / "benchmark.py"


def test_smoke_run_writes_every_output(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--models", "deit_tiny_mhla", "--img-sizes", "64", "--batch-size", "2",
           "--min-run-time", "0.05", "--rounds", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["model"], r["img_size"], r["mode"]) for r in rows} == {
        ("deit_tiny_mhla", "64", "inference"), ("deit_tiny_mhla", "64", "train")}
    for row in rows:
        assert float(row["img_per_s"]) == float(row["batch_size"]) * 1e3 / float(row["step_ms"])
        assert float(row["gmacs"]) > 0 and 5.0 < float(row["params_m"]) < 6.0
    train = next(r for r in rows if r["mode"] == "train")
    assert float(train["peak_mib"]) > 0  # activations and gradients of a training step
    assert "| deit_tiny_mhla | 64 |" in proc.stdout
    assert (tmp_path / "throughput.png").stat().st_size > 0 and (tmp_path / "benchmark.json").exists()


def test_bad_arguments(tmp_path):
    for args, message in ((["--models", "deit_tiny_nope"], "unknown model 'deit_tiny_nope'"),
                          (["--img-sizes", "100"], "100 is not divisible by the patch size 16")):
        proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out-dir", str(tmp_path)], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr
