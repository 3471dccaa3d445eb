"""What a run writes besides checkpoints: resolved config, run info, per-epoch metrics, wandb."""
import csv
import json
import platform
import subprocess
from pathlib import Path

import yaml

from .distributed import world_size

__all__ = ["MetricsLog", "start_wandb", "write_run_info"]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def write_run_info(run_dir: Path, config: dict, argv: list[str]) -> None:
    """``config.yaml`` (resolved, every default filled in) and ``run_info.json`` (git commit, versions, command)."""
    import numpy
    import timm
    import torch
    import torchvision

    plain = {k: v for k, v in config.items() if not k.startswith("_")}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
    info = {
        "git_commit": _git_commit(),
        "command": argv,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__,
                     "torchvision": torchvision.__version__, "numpy": numpy.__version__},
        "world_size": world_size(),
    }
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")


class MetricsLog:
    """``metrics.jsonl`` (one JSON object per epoch) and ``metrics.csv`` with the same rows.

    Writing an epoch that is already there replaces it, so a run resumed after a crash between
    logging and checkpointing never lists an epoch twice.
    """

    def __init__(self, run_dir: Path) -> None:
        self.jsonl, self.csv = run_dir / "metrics.jsonl", run_dir / "metrics.csv"

    def rows(self) -> list[dict]:
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]

    def write(self, row: dict) -> None:
        rows = [r for r in self.rows() if r.get("epoch") != row["epoch"]] + [row]
        rows.sort(key=lambda r: r["epoch"])
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(self.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


def start_wandb(config: dict, run_dir: Path, run_id: str | None):
    """A wandb run (resumed when ``run_id`` is given), or None when ``log.wandb.mode`` is ``disabled``."""
    settings = config["log"]["wandb"]
    if settings["mode"] == "disabled":
        return None
    import wandb

    plain = {k: v for k, v in config.items() if not k.startswith("_")}
    return wandb.init(project=settings["project"], entity=settings["entity"], name=config["run_name"],
                      id=run_id, resume="allow", mode=settings["mode"],
                      dir=str(run_dir), config=plain)
