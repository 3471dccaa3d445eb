"""A run killed with SIGKILL in the middle of an epoch and resumed ends with the same weights."""
import subprocess
import sys

import torch
from helpers import ROOT, make_image_folder, run_train, tiny_config

# Runs train.py, but kills its own process (SIGKILL: no cleanup, no final save) right after
# optimizer step KILL_AT, which is not a checkpoint step: the resumed run must redo that work.
KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
sys.argv = ["train.py"] + {args!r}
import mhla.trainer as trainer

original = trainer._Run.on_step
def on_step(self, state):
    original(self, state)
    if state.step == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
trainer._Run.on_step = on_step
import runpy
runpy.run_path({train!r}, run_name="__main__")
"""


def test_sigkill_mid_epoch_then_resume_gives_the_same_final_weights(tmp_path):
    data = make_image_folder(tmp_path / "data", train_per_class=8)  # 24 images, batch 4: 6 steps an epoch
    config = tiny_config(tmp_path, data, epochs=3, checkpoint={"interval_steps": 2},
                         aug={"mixup": 0.8, "cutmix": 1.0, "auto_augment": "rand-m9-mstd0.5-inc1"},
                         model={"drop_path": 0.1})
    reference = run_train("--config", str(config), "--set", "run_name=reference")
    assert reference.returncode == 0, reference.stderr

    args = ["--config", str(config), "--set", "run_name=killed"]
    script = KILLER.format(root=str(ROOT), args=args, kill_at=9, train=str(ROOT / "train.py"))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "output" / "killed"
    partial = torch.load(run_dir / "last.pth", weights_only=True)["state"]
    assert (partial["epoch"], partial["batch_in_epoch"], partial["step"]) == (1, 2, 8)  # mid-epoch checkpoint

    resumed = run_train(*args, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    final = torch.load(run_dir / "last.pth", weights_only=True)
    expected = torch.load(tmp_path / "output" / "reference" / "last.pth", weights_only=True)
    assert final["state"]["step"] == expected["state"]["step"] == 18
    for name, value in expected["model"].items():
        assert torch.equal(final["model"][name], value), name
    for name, value in expected["ema"].items():
        assert torch.equal(final["ema"][name], value), name
    def metrics(path):  # every logged value but the wall-clock time
        return [line.split('"epoch_time_s"')[0] for line in path.read_text().splitlines()]

    assert metrics(run_dir / "metrics.jsonl") == metrics(tmp_path / "output" / "reference" / "metrics.jsonl")
