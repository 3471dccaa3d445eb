"""Evaluate a checkpoint: top-1, top-5, loss, throughput, params and GMACs, at any resolution.

    python validate.py --config configs/quickstart.yaml --checkpoint output/quickstart/best.pth
    python validate.py --checkpoint output/quickstart/last.pth --dataset mnist5k
    python validate.py --model deit_tiny_mhla --checkpoint weights.pth --data-dir /data/imagenet --img-size 384
    torchrun --nproc_per_node=8 validate.py --config configs/deit_t_mhla.yaml --checkpoint best.pth --ema

The model is found as ``mhla.training.evaluation.resolve_model`` says, the same rule as every script's: a
``train.py`` checkpoint names its own model, keywords, image size, crop and interpolation (what was
trained, ``--set`` overrides included), ``--model`` / ``--model-kwargs`` / ``--img-size`` override
them, and a plain state dict needs ``--model`` (or ``--config``). The data come from ``--config``
(its validation split), or ``--data-dir`` is an ImageFolder (``DIR/val`` if it exists, else ``DIR``
itself), or ``--dataset`` names one (``mnist5k`` needs no directory). Evaluation transforms follow
the model's pretrained cfg (crop_pct, interpolation, mean/std) unless the training config set them.
Problems with the arguments, the checkpoint or the data are one-line errors with exit code 2.
"""
import argparse
import contextlib
import csv
import functools
import json
import sys
from pathlib import Path

import timm
import torch
from timm.data import resolve_data_config
from timm.utils import ParseKwargs
from torch.utils.data import DataLoader, Subset

import models  # noqa: F401  (registers the models)
from mhla.training.config import DATASETS, DEFAULTS, READER_PREFIXES, ConfigError, load_config
from mhla.training.data import (
    AugmentedDataset,
    base_dataset,
    collate_skipping,
    eval_transform,
    image_folder,
    shard_indices,
)
from mhla.training.distributed import init_distributed
from mhla.training.evaluation import load_weights, measure, resolve_model
from mhla.weights import WeightsError, read_checkpoint, unwrap_state_dict

KEYS = ["model", "checkpoint", "img_size", "top1", "top5", "loss", "num_images", "img_per_s", "params", "gmacs"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="train.py checkpoint or a state dict (.pth)")
    parser.add_argument("--config", help="training config: the data (and the model of a plain state dict)")
    parser.add_argument("--model", help="model name (a train.py checkpoint names its own)")
    parser.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE",
                        help="create_model keywords over the checkpoint's, e.g. --model-kwargs form=blocks")
    parser.add_argument("--data-dir", type=Path, help="ImageFolder root (without --config)")
    parser.add_argument("--dataset", choices=DATASETS, default="imagefolder", help="named dataset (without --config)")
    parser.add_argument("--ema", action="store_true", help="evaluate the EMA weights of a train.py checkpoint")
    parser.add_argument("--img-size", type=int, help="resolution (position embeddings are resampled)")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (CUDA)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    parser.add_argument("--csv", type=Path, help="append the result as a CSV row")
    return parser.parse_args(argv)


def resolve(args) -> tuple[dict, dict]:
    """The weights to load (``--ema``: the EMA's) and what to evaluate (model, data, transform); or
    ConfigError/WeightsError."""
    if not Path(args.checkpoint).is_file():
        raise ConfigError(f"--checkpoint: {args.checkpoint} does not exist")
    checkpoint = read_checkpoint(args.checkpoint)
    state = unwrap_state_dict(checkpoint, args.ema, args.checkpoint)
    config = load_config(args.config) if args.config else None
    model = resolve_model(checkpoint, args.model, args.model_kwargs, config, args.ema)
    if config is not None:
        data = config["data"]
        spec = dict(dataset=data["dataset"], root=data["root"], val_fraction=data["val_fraction"],
                    split=data["val_split"])
    else:
        trained = checkpoint.get("config", {}).get("data", {})  # mnist5k: the split the run validated on
        same = trained.get("dataset") == args.dataset
        spec = dict(dataset=args.dataset, root=args.data_dir,
                    val_fraction=trained["val_fraction"] if same else DEFAULTS["data"]["val_fraction"], split=None)
    if spec["dataset"].lower().startswith("wds/"):
        raise ConfigError(f"data.dataset: validate.py reads datasets by index, not WebDataset shards "
                          f"({spec['dataset']}); the training run's metrics hold their validation")
    if spec["dataset"] != "mnist5k" and not spec["dataset"].lower().startswith(READER_PREFIXES):
        if spec["root"] is None:
            raise ConfigError("--data-dir is required for this dataset")
        if not Path(spec["root"]).is_dir():
            raise ConfigError(f"--data-dir: {spec['root']} is not a directory")
    spec.update(model=model.name, kwargs=model.kwargs, crop_pct=model.crop_pct, interpolation=model.interpolation,
                img_size=args.img_size or model.img_size or timm.get_pretrained_cfg(model.name).input_size[-1])
    return state, spec


def dataset_for(spec: dict, from_config: bool):
    root = Path(spec["root"]) if spec["root"] is not None else None
    if spec["dataset"] in ("imagenet", "imagefolder") and not from_config and not (root / "val").is_dir():
        return image_folder(root)
    return base_dataset(spec["dataset"], root or ".", train=False, val_fraction=spec["val_fraction"],
                        split=spec["split"])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        state, spec = resolve(args)
        dataset = dataset_for(spec, bool(args.config))
    except (ConfigError, WeightsError, FileNotFoundError, ImportError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = init_distributed(args.device)
    try:
        model = timm.create_model(spec["model"], num_classes=len(dataset.classes), img_size=spec["img_size"],
                                  **spec["kwargs"])
        load_weights(model, state, args.checkpoint)
    except (WeightsError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = model.to(info.device)
    transform = eval_transform(spec["img_size"], resolve_data_config({}, model=model), spec["crop_pct"],
                               spec["interpolation"])
    shard = Subset(AugmentedDataset(dataset, transform), shard_indices(len(dataset), info.world_size, info.rank))
    loader = DataLoader(shard, batch_size=max(1, args.batch_size // info.world_size), num_workers=args.workers,
                        collate_fn=collate_skipping, pin_memory=info.device.type == "cuda")
    autocast = (functools.partial(torch.autocast, info.device.type, dtype=torch.bfloat16) if args.amp
                else contextlib.nullcontext)
    result = measure(model, loader, info, spec["img_size"], autocast)
    result.update(model=spec["model"], checkpoint=str(args.checkpoint), img_size=spec["img_size"],
                  ema=args.ema)
    if info.is_main:
        print("| " + " | ".join(KEYS) + " |")
        print("|" + "---|" * len(KEYS))
        print("| " + " | ".join(f"{result[k]:.4g}" if isinstance(result[k], float) else str(result[k])
                                for k in KEYS) + " |")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        if args.csv:
            new = not args.csv.exists()
            with open(args.csv, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=[*KEYS, "ema"])
                if new:
                    writer.writeheader()
                writer.writerow({k: result[k] for k in [*KEYS, "ema"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
