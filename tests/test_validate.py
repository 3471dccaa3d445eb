"""validate.py: the accuracy train.py logged, EMA weights, other resolutions, torchrun, clear errors."""
import csv
import json
import re
import subprocess
import sys

import pytest
import timm
import torch
from helpers import ROOT, make_image_folder, run_train, tiny_config

import models  # noqa: F401  (registers the models)
import validate
from mhla.training.evaluation import load_model_spec, resolve_model
from mhla.weights import WeightsError

pytestmark = pytest.mark.slow  # train.py and validate.py in subprocesses


def run_validate(*args, prefix=()):
    cmd = list(prefix or (sys.executable,)) + [str(ROOT / "validate.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    data = make_image_folder(tmp / "data", train_per_class=8, val_per_class=3)
    config = tiny_config(tmp, data, epochs=2)
    proc = run_train("--config", str(config))
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp / "output" / "config"
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return dict(tmp=tmp, data=data, config=config, checkpoint=run_dir / "last.pth", metrics=last)


def test_reports_what_train_logged_for_the_same_weights(trained, tmp_path):
    out, table = tmp_path / "result.json", tmp_path / "results.csv"
    for _ in range(2):
        proc = run_validate("--config", trained["config"], "--checkpoint", trained["checkpoint"], "--workers", 0,
                            "--out", out, "--csv", table)
        assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert {"top1", "top5", "loss", "num_images", "img_per_s", "params", "gmacs", "model", "checkpoint",
            "img_size"} <= result.keys()
    assert result["top1"] == pytest.approx(trained["metrics"]["val_top1"])
    assert result["top5"] == pytest.approx(trained["metrics"]["val_top5"])
    assert result["loss"] == pytest.approx(trained["metrics"]["val_loss"], rel=1e-5)
    assert result["num_images"] == 9 and result["img_per_s"] > 0 and result["gmacs"] > 0
    assert result["params"] == sum(p.numel() for p in torch.load(trained["checkpoint"], weights_only=True)
                                   ["model"].values())
    with open(table) as f:
        assert len(list(csv.DictReader(f))) == 2
    assert "| model | checkpoint |" in proc.stdout


def test_ema_weights_are_evaluated_when_asked(trained, tmp_path):
    results = {}
    for flag in ([], ["--ema"]):
        out = tmp_path / f"r{len(flag)}.json"
        proc = run_validate("--config", trained["config"], "--checkpoint", trained["checkpoint"], "--workers", 0,
                            "--out", out, *flag)
        assert proc.returncode == 0, proc.stderr
        results[bool(flag)] = json.loads(out.read_text())
    assert results[True]["loss"] != pytest.approx(results[False]["loss"], rel=1e-6)
    assert results[True]["top1"] == pytest.approx(trained["metrics"]["ema_val_top1"])


def test_another_resolution_and_two_processes(trained, tmp_path):
    out = tmp_path / "r.json"
    proc = run_validate("--config", trained["config"], "--checkpoint", trained["checkpoint"], "--img-size", 48,
                        "--workers", 0, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["img_size"] == 48 and json.loads(out.read_text())["num_images"] == 9
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    proc = run_validate("--config", trained["config"], "--checkpoint", trained["checkpoint"], "--workers", 0,
                        "--batch-size", 4, "--out", out, prefix=torchrun)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["num_images"] == 9  # 9 images over 2 processes: each counted once
    assert result["top1"] == pytest.approx(trained["metrics"]["val_top1"])


def test_model_and_data_dir_with_a_plain_state_dict_at_another_resolution(trained, tmp_path):
    model = timm.create_model("deit_tiny_mhla", num_classes=3)  # 224 px: positions are resampled to 64 px
    weights = tmp_path / "weights.pth"
    torch.save(model.state_dict(), weights)
    for data_dir in (trained["data"], trained["data"] / "val"):
        out = tmp_path / "r.json"
        proc = run_validate("--model", "deit_tiny_mhla", "--checkpoint", weights, "--data-dir", data_dir,
                            "--img-size", 64, "--workers", 0, "--out", out)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(out.read_text())["num_images"] == 9


def test_errors(trained, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"\x80garbage")
    two_classes = make_image_folder(tmp_path / "two", classes=2)
    other = tmp_path / "other.pth"
    torch.save(timm.create_model("deit_tiny_softmax", num_classes=3).state_dict(), other)
    base = ["--config", trained["config"], "--workers", 0]
    shards = tmp_path / "shards.yaml"
    shards.write_text(f"base: {trained['config']}\ndata:\n  dataset: wds/tiny\n")
    cases = [
        (["--config", shards, "--checkpoint", trained["checkpoint"]],
         "data.dataset: validate.py reads datasets by index, not WebDataset shards \\(wds/tiny\\)"),
        (base + ["--checkpoint", tmp_path / "missing.pth"], "--checkpoint: .*missing.pth does not exist"),
        (base + ["--checkpoint", corrupt], "checkpoint .*corrupt.pth cannot be read"),
        (["--model", "deit_tiny_nope", "--checkpoint", other, "--data-dir", trained["data"]],
         "--model: unknown model 'deit_tiny_nope'"),
        (["--model", "deit_tiny_mhla", "--checkpoint", other, "--data-dir", tmp_path / "nowhere"],
         "--data-dir: .*nowhere is not a directory"),
        (["--model", "deit_tiny_mhla", "--checkpoint", other, "--data-dir", trained["data"], "--img-size", 64],
         "does not fit the model: \\d+ missing keys \\(first: blocks.0.attn.q_norm.weight\\), \\d+ unexpected keys "
         "\\(first: blocks.0.attn.qkv.bias\\)"),
        (["--model", "deit_tiny_softmax", "--checkpoint", other, "--data-dir", two_classes, "--img-size", 32],
         "class-count mismatch: checkpoint .* has 3 classes, the model and data have 2"),
        (["--model", "deit_tiny_softmax", "--checkpoint", other, "--data-dir", trained["data"], "--ema"],
         "--ema: checkpoint .* is a plain state dict"),
        (["--model", "deit_tiny_mhla", "--checkpoint", other, "--data-dir", trained["data"], "--img-size", 32],
         "block_grid 4x4 is larger than the token grid 2x2"),
    ]
    for args, match in cases:  # in-process: the errors come before any heavy work
        assert validate.main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and re.search(match, lines[0]), (match, err)


def test_model_name_with_a_train_checkpoint_builds_what_was_trained(trained, tmp_path):
    """A train.py checkpoint carries its model keywords and image size: ``--model NAME`` needs no more."""
    out = tmp_path / "r.json"
    proc = run_validate("--model", "deit_tiny_mhla", "--checkpoint", trained["checkpoint"], "--data-dir",
                        trained["data"], "--workers", 0, "--out", out)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["img_size"] == 32 and result["num_images"] == 9
    assert result["top1"] == pytest.approx(trained["metrics"]["val_top1"])
    assert result["top5"] == pytest.approx(trained["metrics"]["val_top5"])
    assert result["loss"] == pytest.approx(trained["metrics"]["val_loss"], rel=1e-5)


def test_one_resolver_for_every_loader(trained):
    checkpoint = torch.load(trained["checkpoint"], weights_only=True)
    trained_kwargs = checkpoint["config"]["model"]["kwargs"]
    spec = resolve_model(checkpoint)
    assert (spec.name, spec.kwargs, spec.num_classes, spec.img_size) == ("deit_tiny_mhla", trained_kwargs, 3, 32)
    assert resolve_model(checkpoint, "deit_tiny_mhla", {"form": "blocks"}).kwargs == {**trained_kwargs,
                                                                                      "form": "blocks"}
    assert resolve_model(checkpoint, "deit_tiny_linear").kwargs == {}  # keywords belong to their own model
    with pytest.raises(WeightsError, match="plain state dict, which does not say which model"):
        resolve_model(checkpoint["model"])
    scripted = load_model_spec(f"deit_tiny_mhla:{trained['checkpoint']}", img_size=32)
    assert len(scripted.blocks) == trained_kwargs["depth"] and scripted.embed_dim == trained_kwargs["embed_dim"]


def test_the_checkpoint_gives_the_mnist5k_split_it_validated_on(trained, tmp_path):
    checkpoint = torch.load(trained["checkpoint"], weights_only=True)
    checkpoint["config"]["data"].update(dataset="mnist5k", val_fraction=0.1)
    path = tmp_path / "mnist.pth"
    torch.save(checkpoint, path)
    _, spec = validate.resolve(validate.parse_args(["--checkpoint", str(path), "--dataset", "mnist5k"]))
    assert spec["val_fraction"] == 0.1 and spec["model"] == "deit_tiny_mhla" and spec["img_size"] == 32
