"""Helpers for the tests: the repository root, scripts as modules, small real datasets and configs, tolerances."""
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
# A run on each kind of device of ``mhla.targets``, for the scripts' targets.
TARGET_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="gpu")]


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_rms(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-6) -> float:
    """Relative error, fla-style: ``||a - e|| / max(||e||, floor)`` in float64.

    The floor keeps quantities that are zero in exact arithmetic (the gradient of W when M = 1,
    which scales numerator and denominator alike) from turning rounding into a large ratio.
    """
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(floor)).item()




def make_image_folder(root: Path, classes: int = 3, train_per_class: int = 8, val_per_class: int = 4,
                      size: int = 32) -> Path:
    """An ImageFolder (root/train, root/val) of JPEG files whose colour depends on the class."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                base = np.zeros((size, size, 3))
                base[..., c % 3] = 160
                pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"class_{c}_{i}.jpg", quality=90)  # named as ILSVRC: class first
    return root


def tiny_config(tmp_path: Path, data_root: Path, **sections) -> Path:
    """A config for a one-block MHLA ViT on a small ImageFolder; ``sections`` update its tables."""
    config = {
        "epochs": 2,
        "seed": 3,
        "device": "cpu",
        "output_dir": str(tmp_path / "output"),
        "model": {"name": "deit_tiny_mhla", "drop_path": 0.0,
                  "kwargs": {"embed_dim": 24, "depth": 1, "num_heads": 2, "patch_size": 8, "block_grid": [2, 2]}},
        "data": {"dataset": "imagefolder", "root": str(data_root), "img_size": 32, "batch_size": 4, "workers": 0},
        "aug": {"auto_augment": "rand-m9-mstd0.5-inc1", "mixup": 0.0, "cutmix": 0.0, "crop_pct": 1.0},
        "optim": {"lr": 1e-3},
        "sched": {"warmup_epochs": 1},
        "ema": {"enabled": True, "decay": 0.9},
        "log": {"interval": 1},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_train(*args: str, cwd: Path | None = None, timeout: int = 300,
              prefix: tuple = ()) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` (or ``prefix`` + ``train.py ARGS``) in a subprocess."""
    cmd = list(prefix or (sys.executable,)) + [str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or ROOT, timeout=timeout)
