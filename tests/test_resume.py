"""A run killed with SIGKILL and resumed ends with the same weights, EMA and metrics as an uninterrupted one;
one resumed with another world size says that it continues, not bit-exactly."""
import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, make_image_folder, run_train, tiny_config

import models  # noqa: F401  (registers the models)
from mhla.training.config import load_config
from mhla.training.distributed import DistInfo
from mhla.training.trainer import _Run, run

# Runs train.py, but kills its own process (SIGKILL: no cleanup, no final save) right after optimizer
# step KILL_AT, before the trainer's on_step could checkpoint it: the resumed run must redo that work.
KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
sys.argv = ["train.py"] + {args!r}
import mhla.training.trainer as trainer

original = trainer._Run.on_step
def on_step(self, state):
    if state.step == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, state)
trainer._Run.on_step = on_step
import runpy
runpy.run_path({train!r}, run_name="__main__")
"""


def kill_at(step: int, args: list[str], run_dir) -> dict:
    script = KILLER.format(root=str(ROOT), args=args, kill_at=step, train=str(ROOT / "train.py"))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert killed.returncode == -9, killed.stderr
    state = torch.load(run_dir / "last.pth", weights_only=True)["state"]
    return {k: state[k] for k in ("epoch", "batch_in_epoch", "step")}


@pytest.mark.slow  # train.py in subprocesses, killed and resumed
def test_sigkill_at_an_epoch_end_and_mid_epoch_then_resume_gives_the_same_run(tmp_path):
    # 21 images, micro-batches of 4 (global batch 8, 2 accumulation steps): 5 micro-batches an epoch,
    # so each epoch ends with a group of one micro-batch: 3 updates an epoch, 9 in all.
    data = make_image_folder(tmp_path / "data", train_per_class=7)
    config = tiny_config(tmp_path, data, epochs=3, checkpoint={"interval_steps": 4},
                         data={"batch_size": 8}, optim={"lr": 1e-3, "accum_steps": 2},
                         aug={"mixup": 0.8, "cutmix": 1.0, "auto_augment": "rand-m9-mstd0.5-inc1"},
                         model={"drop_path": 0.1})
    reference = run_train("--config", str(config), "--set", "run_name=reference")
    assert reference.returncode == 0, reference.stderr

    args = ["--config", str(config), "--set", "run_name=killed"]
    run_dir = tmp_path / "output" / "killed"
    # killed before step 4 is saved: the last checkpoint is epoch 0's end, after its short last group
    assert kill_at(4, args, run_dir) == {"epoch": 1, "batch_in_epoch": 0, "step": 3}
    # resumed across that epoch boundary, killed again before step 9: step 8's mid-epoch checkpoint
    assert kill_at(9, args + ["--resume", "auto"], run_dir) == {"epoch": 2, "batch_in_epoch": 4, "step": 8}
    resumed = run_train(*args, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr

    final = torch.load(run_dir / "last.pth", weights_only=True)
    expected = torch.load(tmp_path / "output" / "reference" / "last.pth", weights_only=True)
    assert final["state"]["step"] == expected["state"]["step"] == 9
    for name, value in expected["model"].items():
        assert torch.equal(final["model"][name], value), name
    for name, value in expected["ema"].items():
        assert torch.equal(final["ema"][name], value), name

    def metrics(path):  # every logged value but the wall-clock time
        return [line.split('"epoch_time_s"')[0] for line in path.read_text().splitlines()]

    reference_metrics = tmp_path / "output" / "reference" / "metrics.jsonl"
    assert metrics(run_dir / "metrics.jsonl") == metrics(reference_metrics)
    # the scheduler counts the short groups: the cosine reaches min_lr at the last update, not before
    lrs = [json.loads(line)["lr"] for line in reference_metrics.read_text().splitlines()]
    assert lrs[-1] == 1e-5 and lrs[-2] > 1e-5


def test_resuming_with_another_world_size_says_the_run_is_not_bit_exact(tmp_path, capsys):
    config = load_config(tiny_config(tmp_path, make_image_folder(tmp_path / "data"), epochs=1))
    path = tmp_path / "output" / config["run_name"] / "last.pth"
    finished = _Run(config, DistInfo(0, 1, 0, torch.device("cpu")), path.parent)
    finished.state.epoch = 1  # the run's last epoch is done: resuming restores it and trains no further
    finished.save(path.name)

    def resume_notes() -> list[str]:
        capsys.readouterr()
        assert run(config, resume="auto") == []
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: resume:")]

    assert resume_notes() == []
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["rng"] = checkpoint["rng"] * 2  # as written by 2 processes
    torch.save(checkpoint, path)
    assert resume_notes() == ["note: resume: the checkpoint was written by 2 processes, this run has 1 process: the "
                              "random generators are reseeded, so the run continues but not bit-exactly"]
