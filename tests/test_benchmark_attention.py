"""scripts/benchmark_attention.py: a smoke run on tiny settings, the target arithmetic, bad sizes."""
import csv
import subprocess
import sys

import pytest
from helpers import ROOT, load_script

benchmark_attention = load_script("benchmark_attention")


@pytest.mark.slow  # the script in a subprocess
def test_smoke_run_writes_table_csv_and_plot(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_attention.py"), "--sizes", "16", "64",
           "--methods", "linear", "mhla", "--batch-size", "1", "--heads", "1", "--head-dim", "8",
           "--block-grid", "2", "2", "--min-run-time", "0.02", "--rounds", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| N | linear fwd ms | mhla fwd ms |" in proc.stdout
    assert "MHLA / linear time, N=64, train" in proc.stdout
    with open(tmp_path / "attention_benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["method"], r["n"], r["mode"]) for r in rows} == {
        (m, n, mode) for m in ("linear", "mhla") for n in ("16", "64") for mode in ("forward", "train")}
    assert all(float(r["time_ms"]) > 0 and float(r["peak_mib"]) >= 0 for r in rows)
    assert (tmp_path / "attention_benchmark.png").stat().st_size > 0
    assert (tmp_path / "attention_benchmark.md").read_text().count("\n|") >= 4


def test_targets_arithmetic():
    def row(method, n, mode, time_ms, peak_mib=1.0):
        return dict(method=method, n=n, mode=mode, time_ms=time_ms, peak_mib=peak_mib)

    rows = [row("linear", 196, "forward", 1.0), row("mhla", 196, "forward", 1.2), row("sdpa", 196, "forward", 0.5),
            row("sdpa", 4096, "train", 300.0), row("mhla", 4096, "train", 10.0),
            row("mhla", 1024, "train", 1.0, peak_mib=10.0), row("mhla", 16384, "train", 20.0, peak_mib=250.0)]
    result = {name: (value, met) for name, value, _, met in benchmark_attention.targets(rows)}
    assert result["MHLA / linear time, N=196, forward"] == pytest.approx((1.2, True))
    assert result["SDPA / MHLA time, N=4096, train"] == pytest.approx((30.0, True))
    assert result["MHLA / SDPA time, N=196, forward"] == pytest.approx((2.4, False))
    assert result["MHLA peak memory N=16384 / N=1024, train"] == pytest.approx((25.0, False))


def test_non_square_size_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        benchmark_attention.parse_args(["--sizes", "200"])
    assert exc.value.code == 2
    assert "200 is not a square number of tokens" in capsys.readouterr().err
