"""train.py end to end on small ImageFolders of real JPEG files (slow ones in subprocesses)."""
import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import make_image_folder, run_train, tiny_config

import models  # noqa: F401  (registers the models)
from mhla.training.config import load_config
from mhla.training.data import EpochSampler, image_folder
from mhla.training.trainer import run

METRIC_KEYS = {"epoch", "train_loss", "val_loss", "val_top1", "val_top5", "lr", "epoch_time_s"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    config = tiny_config(tmp, make_image_folder(tmp / "data"), checkpoint={"keep": 1},
                         log={"interval": 1, "wandb": {"mode": "offline"}})
    proc = run_train("--config", str(config), "--set", "epochs=3")
    assert proc.returncode == 0, proc.stderr
    return tmp / "output" / "config", proc


@pytest.mark.slow
def test_run_directory(finished_run):
    run_dir, _ = finished_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["epochs"] == 3 and config["optim"]["betas"] == [0.9, 0.999]  # resolved, defaults included
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["git_commit"] and info["versions"]["torch"] == torch.__version__
    assert {p.name for p in run_dir.glob("*.pth")} == {"last.pth", "best.pth", "epoch_0002.pth"}


@pytest.mark.slow
def test_metrics_files(finished_run):
    run_dir, _ = finished_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert all(METRIC_KEYS <= r.keys() for r in rows)
    assert all(0 <= r["val_top1"] <= r["val_top5"] <= 100 and r["val_images"] == 12 for r in rows)
    with open(run_dir / "metrics.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [float(r["val_top1"]) for r in csv_rows] == [r["val_top1"] for r in rows]


@pytest.mark.slow
def test_checkpoints_hold_plain_types_and_the_best_epoch(finished_run):
    run_dir, _ = finished_run
    last = torch.load(run_dir / "last.pth", weights_only=True)
    best = torch.load(run_dir / "best.pth", weights_only=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert last["state"]["epoch"] == 3 and last["state"]["batch_in_epoch"] == 0
    assert best["state"]["best_top1"] == max(r["val_top1"] for r in rows)
    assert last["model_name"] == "deit_tiny_mhla" and last["ema"] is not None


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics(finished_run):
    run_dir, _ = finished_run
    wandb_id = torch.load(run_dir / "last.pth", weights_only=True)["state"]["wandb_id"]
    records = list(run_dir.glob(f"wandb/offline-run-*-{wandb_id}/run-{wandb_id}.wandb"))
    assert len(records) == 1
    data = records[0].read_bytes()  # wandb's record log: history values are stored as JSON text
    for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        for key in ("val_top1", "train_loss", "val_loss"):
            assert key.encode() in data and json.dumps(row[key]).encode() in data, key


@pytest.mark.slow
def test_unreadable_image_stops_naming_the_file_or_is_skipped(tmp_path):
    data = make_image_folder(tmp_path / "data")
    bad = data / "train" / "class_1" / "broken.jpg"
    bad.write_bytes(b"not a jpeg")
    config = tiny_config(tmp_path, data)
    proc = run_train("--config", str(config), "--set", "epochs=1")
    assert proc.returncode != 0 and f"cannot read image {bad}" in proc.stderr
    proc = run_train("--config", str(config), "--set", "epochs=1", "--set", "data.on_bad_image=skip",
                     "--set", "run_name=skip")
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "output" / "skip" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["skipped_images"] == 1


def test_skipping_unreadable_images_with_mixup_counts_what_it_left_out(tmp_path):
    """Epoch 0's first batch all unreadable, one image of its second: the batch size is 4 and mixup needs pairs, so
    the first batch is left out and the second drops a readable image. The first validation batch is unreadable too."""
    data = make_image_folder(tmp_path / "data")
    config = load_config(tiny_config(tmp_path, data, epochs=1, data={"on_bad_image": "skip"},
                                     aug={"mixup": 0.8, "cutmix": 1.0}))
    train = image_folder(data / "train")
    order = [index for _, index in EpochSampler(len(train), 4, seed=config["seed"])]
    val = image_folder(data / "val")
    for dataset, indices in ((train, order[:5]), (val, range(4))):
        for index in indices:
            Path(dataset.reader.filename(index, absolute=True)).write_bytes(b"not a jpeg")
    rows = run(config)
    counts = ("step", "skipped_images", "unpaired_images", "empty_batches", "val_images", "val_skipped_images")
    assert [rows[0][key] for key in counts] == [6, 5, 1, 1, 8, 4]
    logged = json.loads((tmp_path / "output" / "config" / "metrics.jsonl").read_text())
    assert [logged[key] for key in counts] == [6, 5, 1, 1, 8, 4]


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    config = tiny_config(tmp_path, make_image_folder(tmp_path / "data"), optim={"lr": 1e30, "weight_decay": 0.0},
                         sched={"warmup_epochs": 0}, checkpoint={"interval_steps": 1}, ema={"enabled": False})
    proc = run_train("--config", str(config))
    assert proc.returncode == 1
    message = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(message) == 1 and "training stopped" in message[0]
    failed_step = int(message[0].split(" at step ")[1].split()[0])
    last = torch.load(tmp_path / "output" / "config" / "last.pth", weights_only=True)
    assert last["state"]["step"] == failed_step - 1


@pytest.mark.slow
def test_gradient_accumulation_matches_one_large_batch(tmp_path):
    config = tiny_config(tmp_path, make_image_folder(tmp_path / "data"), epochs=1, data={"batch_size": 8},
                         ema={"enabled": False}, optim={"lr": 1e-3, "clip_grad": 1.0})
    for name, accum in (("whole", 1), ("accumulated", 2)):
        proc = run_train("--config", str(config), "--set", f"run_name={name}", "--set", f"optim.accum_steps={accum}")
        assert proc.returncode == 0, proc.stderr
    whole, accumulated = (torch.load(tmp_path / "output" / n / "last.pth", weights_only=True)
                          for n in ("whole", "accumulated"))
    assert whole["state"]["step"] == accumulated["state"]["step"] == 3
    for name, value in whole["model"].items():
        torch.testing.assert_close(accumulated["model"][name], value, rtol=1e-4, atol=1e-6, msg=name)
