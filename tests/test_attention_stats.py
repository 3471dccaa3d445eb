"""scripts/attention_stats.py on real photos and on a plain folder of images."""
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, load_script, make_image_folder, run_train, tiny_config
from PIL import Image


def run_stats(*args):
    cmd = [sys.executable, str(ROOT / "scripts" / "attention_stats.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow  # the script in a subprocess
def test_stats_of_three_kinds_on_photos(tmp_path):
    proc = run_stats("--model", "deit_tiny_linear", "--model", "deit_tiny_mhla", "--dataset", "photos",
                     "--num-images", 2, "--img-size", 160, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((tmp_path / "stats.json").read_text())
    linear, mhla = stats["deit_tiny_linear"], stats["deit_tiny_mhla"]
    assert linear["num_tokens"] == mhla["num_tokens"] == 100 and linear["head_dim"] == 64
    assert linear["num_images"] == 2 and len(linear["layers"]) == 12 and len(linear["layers"][0]["rank"]) == 3
    assert linear["rank_mean"] <= 64 < mhla["rank_mean"]  # linear attention's rank is capped by the head dim
    assert 0 < mhla["entropy_mean"] <= np.log(100) + 1e-9
    assert "| deit_tiny_linear | 100 | 64 |" in proc.stdout and "58.4" in proc.stdout
    assert (tmp_path / "rank_entropy.png").stat().st_size > 0 and (tmp_path / "per_layer.png").stat().st_size > 0


@pytest.mark.slow  # the script in a subprocess
def test_plain_folder_of_images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        pixels = np.random.default_rng(i).integers(0, 255, (40, 50, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    proc = run_stats("--model", "deit_tiny_softmax", "--data-dir", folder, "--img-size", 64, "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "o" / "stats.json").read_text())["deit_tiny_softmax"]["num_images"] == 3


@pytest.mark.slow  # the script in a subprocess
def test_attention_maps_png(tmp_path):
    out = tmp_path / "maps.png"
    cmd = [sys.executable, str(ROOT / "scripts" / "attention_maps.py"), "--model", "deit_tiny_linear", "--model",
           "deit_tiny_mhla", "--image", "astronaut", "--img-size", 64, "--query", 1, 2, "--out", out]
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    image = Image.open(out)
    assert image.size[0] > image.size[1] > 100  # a row per model, a column per layer
    bad = subprocess.run(list(map(str, cmd[:-2] + ["--query", 9, 9, "--out", out])), capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert bad.returncode != 0 and "outside the 4x4 token grid" in bad.stderr


@pytest.mark.slow  # the script in a subprocess
def test_config_as_model_source_with_its_checkpoint_and_lepe(tmp_path):
    config = tiny_config(tmp_path, make_image_folder(tmp_path / "data"), epochs=1)
    assert run_train("--config", str(config)).returncode == 0
    checkpoint = tmp_path / "output" / "config" / "last.pth"
    for extra, name in (([], "plain"), (["--include-lepe"], "lepe")):
        proc = run_stats("--model", f"{config}:{checkpoint}", "--data-dir", tmp_path / "data" / "val", "--img-size",
                         32, "--num-images", 4, "--out", tmp_path / name, *extra)
        assert proc.returncode == 0, proc.stderr
    plain, lepe = (json.loads((tmp_path / n / "stats.json").read_text())[f"{config}:{checkpoint}"]
                   for n in ("plain", "lepe"))
    assert plain["num_tokens"] == 16 and plain["head_dim"] == 12 and lepe["include_lepe"]
    assert plain["entropy_mean"] != lepe["entropy_mean"]


def test_a_bad_model_spec_fails_before_any_model_runs(tmp_path, capsys):
    stats = load_script("attention_stats")
    out = tmp_path / "out"
    assert stats.main(["--model", "deit_tiny_linear", "--model", "deit_tiny_nope", "--img-size", "32",
                       "--num-images", "1", "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --model: unknown model 'deit_tiny_nope'"] and not out.exists()
