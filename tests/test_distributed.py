"""torchrun with 2 CPU processes (gloo) trains like 1 process with the same global batch."""
import json
import sys

import pytest
import torch
from helpers import make_image_folder, run_train, tiny_config

pytestmark = pytest.mark.slow  # torchrun with 2 processes


def test_two_processes_match_one(tmp_path):
    data = make_image_folder(tmp_path / "data", train_per_class=8, val_per_class=3)  # 9 val images: uneven shards
    config = tiny_config(tmp_path, data, epochs=2, data={"batch_size": 8, "workers": 0})
    single = run_train("--config", str(config), "--set", "run_name=single")
    assert single.returncode == 0, single.stderr
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    double = run_train("--config", str(config), "--set", "run_name=double", prefix=torchrun)
    assert double.returncode == 0, double.stderr

    out = tmp_path / "output"
    one, two = (torch.load(out / name / "last.pth", weights_only=True) for name in ("single", "double"))
    assert one["state"]["step"] == two["state"]["step"] == 6
    for name, value in one["model"].items():
        torch.testing.assert_close(two["model"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    rows = [[json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("single", "double")]
    for a, b in zip(*rows, strict=True):
        assert a["val_images"] == b["val_images"] == 9  # every image counted once
        assert abs(a["val_top1"] - b["val_top1"]) < 1e-6
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4
    assert json.loads((out / "double" / "run_info.json").read_text())["world_size"] == 2
