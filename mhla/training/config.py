"""Run configuration: one table of defaults, YAML files that hold only what they change, validation.

A config file may name a ``base:`` file (relative to itself) whose values it overrides, key by key
(nested tables merge, ``model.kwargs`` too). ``--set key=value`` overrides use dotted keys and YAML
values (``--set optim.lr=5e-4 --set model.kwargs.block_grid=[1,1]``) and merge the same way. Every
value is checked against the defaults before any work starts; a problem is a ``ConfigError`` whose
one-line message names the key and the file.
"""
import copy
import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from .compiling import COMPILE_CHOICES
from .distributed import world_size

__all__ = ["DATASETS", "DEFAULTS", "ConfigError", "check_resources", "load_config", "micro_batch_size",
           "parse_overrides", "validate", "where_set"]

DATASETS = ("imagenet", "imagefolder", "cifar10", "cifar100", "mnist5k")
# Prefixes of timm dataset names (``timm.data.create_reader``) that ``data.dataset`` may take: hfds/NAME (map-style),
# wds/NAME (WebDataset shards, read as a stream: mhla/training/shards.py).
READER_PREFIXES = ("hfds/", "wds/")

DEFAULTS: dict[str, Any] = {
    "run_name": None,  # default: the config file's name
    "output_dir": "output",
    "seed": 0,
    "epochs": 300,
    "device": "auto",  # auto | cpu | cuda
    "compile": False,  # false | true (torch.compile the whole model) | blocks (each block in place)
    "model": {
        "name": "deit_tiny_mhla",
        "kwargs": {},  # passed to timm.create_model
        "drop_path": 0.1,
        "init_from": None,  # a checkpoint to start from (mhla/training/finetune.py); ignored on resume
    },
    "data": {
        "dataset": "imagenet",
        "root": "data/imagenet",
        "train_split": None,  # default: train (a folder or tar under root; an hfds/ split)
        "val_split": None,  # default: val (folder or tar), validation (hfds/, wds/)
        "num_classes": None,  # default: the dataset's (wds/: _info.json's num_classes)
        "download": False,  # torchvision datasets (cifar10, cifar100) only
        "img_size": 224,
        "batch_size": 1024,  # global: split over processes and accumulation steps
        "val_batch_size": None,  # global; default: batch_size
        "workers": 8,
        "persistent_workers": True,  # keep the loader workers across epochs (with workers > 0)
        "prefetch_factor": None,  # batches each worker loads ahead; default: PyTorch's (2)
        "pin_memory": None,  # default: on CUDA
        "on_bad_image": "error",  # error | skip
        "val_fraction": 0.2,  # mnist5k only
    },
    "aug": {
        "auto_augment": "rand-m9-mstd0.5-inc1",
        "scale": [0.08, 1.0],
        "hflip": 0.5,
        "color_jitter": 0.3,
        "interpolation": "bicubic",
        "reprob": 0.25,
        "mixup": 0.8,
        "cutmix": 1.0,
        "mixup_prob": 1.0,
        "mixup_switch_prob": 0.5,
        "label_smoothing": 0.1,
        "crop_pct": None,  # evaluation; default: the model's pretrained cfg
    },
    "optim": {
        "name": "adamw",
        "lr": 1e-3,  # set explicitly: no automatic batch-size scaling
        "weight_decay": 0.05,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "clip_grad": None,
        "accum_steps": 1,
    },
    "sched": {
        "name": "cosine",
        "warmup_epochs": 5,
        "warmup_lr": 1e-6,
        "min_lr": 1e-5,
    },
    "ema": {
        "enabled": True,
        "decay": 0.99996,
    },
    "amp": {
        "enabled": True,  # on CUDA only
        "dtype": "bfloat16",  # bfloat16 | float16 (with a grad scaler)
    },
    "checkpoint": {
        "interval_steps": 0,  # also save last.pth every N optimizer steps (0: only at epoch ends)
        "keep": 0,  # keep the last k epoch_XXXX.pth snapshots (0: none)
    },
    "log": {
        "interval": 50,
        "wandb": {
            "mode": "disabled",  # online | offline | disabled
            "project": "mhla",
            "entity": None,
        },
    },
}

# Keys whose value is free-form (not checked key by key against the defaults).
FREE_FORM = {"model.kwargs"}
# Keys that may be None (null), with the type they take otherwise.
OPTIONAL_TYPES = {"run_name": str, "data.val_batch_size": int, "data.train_split": str, "data.val_split": str,
                  "data.prefetch_factor": int, "data.pin_memory": bool, "data.num_classes": int,
                  "optim.clip_grad": float, "aug.crop_pct": float, "aug.auto_augment": str, "log.wandb.entity": str,
                  "model.init_from": str}
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "compile": COMPILE_CHOICES,
    "data.on_bad_image": ("error", "skip"),
    "amp.dtype": ("bfloat16", "float16"),
    "log.wandb.mode": ("online", "offline", "disabled"),
}
RANGES = {  # key: (low, high, low inclusive)
    "epochs": (1, None, True), "data.img_size": (1, None, True), "data.batch_size": (1, None, True),
    "data.val_batch_size": (1, None, True), "data.workers": (0, None, True), "data.prefetch_factor": (1, None, True),
    "data.num_classes": (1, None, True),
    "data.val_fraction": (0, 1, False),
    "optim.lr": (0, None, False), "optim.weight_decay": (0, None, True), "optim.eps": (0, None, False),
    "optim.clip_grad": (0, None, False), "optim.accum_steps": (1, None, True), "sched.warmup_epochs": (0, None, True),
    "sched.warmup_lr": (0, None, True), "sched.min_lr": (0, None, True), "ema.decay": (0, 1, False),
    "model.drop_path": (0, 1, True), "aug.hflip": (0, 1, True), "aug.reprob": (0, 1, True),
    "aug.mixup": (0, None, True), "aug.cutmix": (0, None, True), "aug.mixup_prob": (0, 1, True),
    "aug.mixup_switch_prob": (0, 1, True), "aug.label_smoothing": (0, 1, True), "aug.crop_pct": (0, 1, False),
    "checkpoint.interval_steps": (0, None, True), "checkpoint.keep": (0, None, True), "log.interval": (1, None, True),
}


class ConfigError(ValueError):
    """A problem with a config value; the message names the key and where it came from."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``5e-4`` (no dot) as a string; here it is a float, as people mean it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$"),
    list("-+0123456789."),
)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level")
    return data


def _merge(base: dict, update: dict, sources: dict, source: str, prefix: str = "") -> dict:
    """``base`` updated by ``update``, key by key (nested tables merge, free-form ones too); records
    where each key came from."""
    out = dict(base)
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, sources, source, dotted + ".")
        else:
            out[key] = value
            sources[dotted] = source
    return out


def _load_file(path: Path, sources: dict, seen: tuple = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to itself")
    data = _read_yaml(path)
    base = data.pop("base", None)
    merged = {}
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: 'base' must be a file name")
        merged = _load_file(path.parent / base, sources, seen + (path,))
    return _merge(merged, data, sources, str(path))


def parse_overrides(items: list[str]) -> dict:
    """``["optim.lr=5e-4", "epochs=1"]`` -> nested dict with YAML-typed values."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.load(raw, Loader=_Loader) if raw else None
    return out


def load_config(path: str | Path, overrides: list[str] = ()) -> dict:
    """Defaults <- base chain <- file <- ``--set`` overrides, validated; adds ``_sources`` (key -> origin)."""
    sources: dict[str, str] = {}
    config = _merge(copy.deepcopy(DEFAULTS), _load_file(Path(path), sources), {}, "")
    config = _merge(config, parse_overrides(list(overrides)), sources, "--set")
    if config.get("run_name") is None:
        config["run_name"] = Path(path).stem
    validate(config, sources)
    config["_sources"] = sources
    return config


def where_set(key: str, sources: dict) -> str:
    """Where ``key`` (or the table that holds it) was set."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        source = sources.get(".".join(parts[:end]))
        if source:
            return f" (from {source})"
    return ""


def _check_type(key: str, value: Any, default: Any, sources: dict) -> None:
    if value is None and key in OPTIONAL_TYPES:
        return
    expected = OPTIONAL_TYPES[key] if default is None else type(default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        raise ConfigError(f"{key}: expected {expected.__name__}, got {type(value).__name__} {value!r}"
                          f"{where_set(key, sources)}")


def check_resources(config: dict) -> None:
    """What the values point at: a registered model, an existing ``model.init_from`` file, an existing data
    directory, a divisible batch.

    Call after the model registrations are imported (``import models``).
    """
    import timm

    sources = config.get("_sources", {})
    name = config["model"]["name"]
    if not timm.is_model(name):
        hint = difflib.get_close_matches(name, timm.list_models("deit_*"), n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        raise ConfigError(f"model.name: unknown model {name!r}{where_set('model.name', sources)}{suggestion}")
    init_from = config["model"]["init_from"]
    if init_from is not None and not Path(init_from).is_file():
        raise ConfigError(f"model.init_from: checkpoint {init_from} does not exist"
                          f"{where_set('model.init_from', sources)}")
    data = config["data"]
    world, accum = world_size(), config["optim"]["accum_steps"]
    if data["batch_size"] % (world * accum):
        raise ConfigError(f"data.batch_size: {data['batch_size']} is not divisible by {world} process(es) x "
                          f"{accum} accumulation step(s){where_set('data.batch_size', sources)}")
    per_process = micro_batch_size(config, world)
    if (config["aug"]["mixup"] > 0 or config["aug"]["cutmix"] > 0) and per_process % 2:
        raise ConfigError(f"data.batch_size: the per-process batch ({per_process}) must be even with mixup/cutmix"
                          f"{where_set('data.batch_size', sources)}")
    root = Path(data["root"])
    if data["dataset"] in ("imagenet", "imagefolder"):
        for split, default in (("train", "train"), ("val", "val")):
            path = root / (data[f"{split}_split"] or default)
            if not (path.is_dir() or path.is_file() and path.suffix == ".tar"):
                raise ConfigError(f"data.root: {path} is neither a directory nor a .tar (expected root/train and "
                                  f"root/val, or data.{split}_split naming one){where_set('data.root', sources)}")
    elif data["dataset"].lower().startswith(READER_PREFIXES):
        from .data import reader_package

        missing = reader_package(data["dataset"])
        if missing:
            raise ConfigError(f"data.dataset: {data['dataset']!r} needs the {missing[1]!r} package: pip install "
                              f"{missing[1]}{where_set('data.dataset', sources)}")
        if data["dataset"].lower().startswith("wds/"):
            _check_shards(root, data, sources)
    elif data["dataset"] in ("cifar10", "cifar100") and not data["download"] and not root.is_dir():
        raise ConfigError(f"data.root: {root} does not exist; set data.download: true to fetch "
                          f"{data['dataset']}{where_set('data.root', sources)}")


def _check_shards(root: Path, data: dict, sources: dict) -> None:
    """WebDataset shards: ``root`` a directory, and a class count (``data.num_classes`` or ``_info.json``'s)."""
    if not root.is_dir():
        raise ConfigError(f"data.root: {root} is not a directory (WebDataset shards and their _info.json)"
                          f"{where_set('data.root', sources)}")
    if data["num_classes"] is None:
        from timm.data.readers.reader_wds import _load_info

        if not _load_info(str(root)).get("num_classes"):
            raise ConfigError(f"data.num_classes: the shards' info under {root} states no num_classes; set it"
                              f"{where_set('data.dataset', sources)}")


def micro_batch_size(config: dict, world: int) -> int:
    """Samples per process and forward pass: the global ``data.batch_size`` over processes and accumulation steps."""
    return config["data"]["batch_size"] // (world * config["optim"]["accum_steps"])


def _walk(config: dict, defaults: dict, sources: dict, prefix: str = "") -> None:
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if key == "_sources":
            continue
        if key not in defaults:
            hint = difflib.get_close_matches(key, list(defaults), n=1)
            suggestion = f"; did you mean '{prefix}{hint[0]}'?" if hint else ""
            raise ConfigError(f"unknown key {dotted!r}{where_set(dotted, sources)}{suggestion}")
        default = defaults[key]
        if dotted in FREE_FORM:
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}: expected a mapping, got {value!r}{where_set(dotted, sources)}")
            continue
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}: expected a table of keys, got {value!r}{where_set(dotted, sources)}")
            _walk(value, default, sources, dotted + ".")
            continue
        if dotted in CHOICES:  # compared with their types: 1 is not True
            if not any(type(value) is type(choice) and value == choice for choice in CHOICES[dotted]):
                raise ConfigError(f"{dotted}: {value!r} is not one of {CHOICES[dotted]}{where_set(dotted, sources)}")
            continue
        _check_type(dotted, value, default, sources)
        if dotted in RANGES and value is not None:
            low, high, inclusive = RANGES[dotted]
            if (value < low if inclusive else value <= low) or (high is not None and value > high):
                bound = f"{'>=' if inclusive else '>'} {low}" + (f" and <= {high}" if high is not None else "")
                raise ConfigError(f"{dotted}: {value!r} is out of range (must be {bound}){where_set(dotted, sources)}")


def validate(config: dict, sources: dict | None = None) -> None:
    """Check keys, types, choices and ranges against ``DEFAULTS``; raise ``ConfigError`` on the first problem."""
    sources = sources or {}
    _walk(config, DEFAULTS, sources)
    dataset = config["data"]["dataset"]
    if dataset not in DATASETS and not dataset.lower().startswith(READER_PREFIXES):
        raise ConfigError(f"data.dataset: {dataset!r} is not one of {DATASETS} nor a timm reader name "
                          f"({', '.join(p + 'NAME' for p in READER_PREFIXES)}){where_set('data.dataset', sources)}")
    for key in ("aug.scale", "optim.betas"):
        section, name = key.split(".")
        value = config[section][name]
        if len(value) != 2 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{key}: expected two numbers, got {value!r}{where_set(key, sources)}")
