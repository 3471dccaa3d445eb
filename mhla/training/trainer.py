"""A training run from a validated config: model, data, recipe, epochs, checkpoints, resume.

Everything is timm's: ``create_model``, ``create_transform``, ``Mixup`` with ``SoftTargetCrossEntropy``,
``create_optimizer_v2``, ``create_scheduler_v2`` (stepped per update), ``ModelEmaV3``. The model
registrations must be imported by the caller (``import models``), as ``train.py`` does.
"""
import contextlib
import dataclasses
import functools
import itertools
import math
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
from timm.data import Mixup, resolve_data_config
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, unwrap_model
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

from .checkpoint import get_rng_state, load_checkpoint, save_atomic, set_rng_state
from .compiling import compile_blocks, model_blocks
from .config import ConfigError, micro_batch_size, where_set
from .data import EpochSampler, build_datasets, collate_skipping, shard_indices
from .distributed import DistInfo, init_distributed
from .engine import COUNTS, TrainState, evaluate, train_one_epoch
from .finetune import init_state_dict, load_init_weights
from .run_log import MetricsLog, start_wandb, write_run_info
from .shards import shard_datasets

__all__ = ["build_model", "build_optimizer", "build_scheduler", "check_buildable", "resolve_resume", "run"]


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """``auto``: the run's ``last.pth`` if there is one; a path: that file; None: a fresh run."""
    if resume is None:
        return None
    if resume == "auto":
        path = run_dir / "last.pth"
        return path if path.is_file() else None
    return Path(resume)


def build_model(config: dict, num_classes: int) -> torch.nn.Module:
    """The config's timm model (``model.name``, ``model.kwargs``, ``model.drop_path``, ``data.img_size``)."""
    model = config["model"]
    return timm.create_model(model["name"], num_classes=num_classes, img_size=config["data"]["img_size"],
                             drop_path_rate=model["drop_path"], **model["kwargs"])


def build_optimizer(model: torch.nn.Module, optim: dict) -> torch.optim.Optimizer:
    """timm's optimizer factory on the ``optim`` table (W is left out of weight decay by the model)."""
    return create_optimizer_v2(model, opt=optim["name"], lr=optim["lr"], weight_decay=optim["weight_decay"],
                               betas=tuple(optim["betas"]), eps=optim["eps"])


def build_scheduler(optimizer: torch.optim.Optimizer, config: dict, updates_per_epoch: int):
    """timm's scheduler factory on the ``sched`` table, stepped per optimizer update."""
    sched = config["sched"]
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=sched["name"], num_epochs=config["epochs"], warmup_epochs=sched["warmup_epochs"],
        warmup_lr=sched["warmup_lr"], min_lr=sched["min_lr"], step_on_epochs=False,
        updates_per_epoch=updates_per_epoch)
    return scheduler


def _model_key(message: str, config: dict) -> str:
    """The config key an error message from building the model is about: a key it names, else ``model.kwargs``."""
    words = set(re.findall(r"\w+", message))
    sources = config.get("_sources", {})
    keys = ["data.img_size"] + [f"model.kwargs.{k}" for k in config["model"]["kwargs"]]
    named = [key for key in keys if key.rsplit(".", 1)[-1] in words]
    named.sort(key=lambda key: sources.get(key) != "--set")  # stable: what the command line set comes first
    return named[0] if named else "model.kwargs"


# What a bad value in the config makes a builder raise: the models' own checks a ValueError naming the
# keyword, timm's and torch's constructors a ValueError for a bad value, a TypeError for an unknown
# keyword or a wrong type. Any other error (RuntimeError, AssertionError, KeyError, ...) is a code path
# failing, not an argument refused: it keeps its traceback.
_ARGUMENT_ERRORS = (ValueError, TypeError)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@contextlib.contextmanager
def _config_error(key: str, sources: dict, errors: tuple[type[Exception], ...] = _ARGUMENT_ERRORS):
    """Turn one of ``errors`` raised while building from the config into a ``ConfigError`` naming ``key``."""
    try:
        yield
    except errors as e:
        raise ConfigError(f"{key}: {_first_line(e)}{where_set(key, sources)}") from None


def check_buildable(config: dict) -> None:
    """Build the model on the ``meta`` device (no memory, no work), its optimizer and its scheduler.

    With ``model.init_from``, the file's weights are fitted to the model (read, positions resampled,
    keys and shapes checked; nothing loaded). Raises ``ConfigError``: one line naming the key the problem
    is about and where it was set, for the errors that refuse an argument (``_ARGUMENT_ERRORS``) or a
    weights file; any other error is a bug and propagates with its traceback. Call after ``check_resources``
    (the model name is registered, the ``model.init_from`` file exists).
    """
    sources, name = config.get("_sources", {}), config["model"]["name"]
    try:
        with torch.device("meta"):
            model = build_model(config, num_classes=timm.get_pretrained_cfg(name).num_classes)
    except _ARGUMENT_ERRORS as e:
        key = _model_key(_first_line(e), config)
        raise ConfigError(f"{key}: cannot build {name}: {_first_line(e)}{where_set(key, sources)}") from None
    if config["model"]["init_from"] is not None:
        with _config_error("model.init_from", sources):  # WeightsError is a ValueError
            init_state_dict(config["model"]["init_from"], model)
    if config["compile"] == "blocks":
        with _config_error("compile", sources):
            model_blocks(model)
    with _config_error("optim.name", sources):
        optimizer = build_optimizer(model, config["optim"])
    with _config_error("sched.name", sources):
        build_scheduler(optimizer, config, updates_per_epoch=1)


def _seed(seed: int) -> None:
    """Seed Python, NumPy and torch. Not ``timm.utils.random_seed``: resume reseeds with numbers past
    2**32 (seed + 1,000,003 x step + rank), which NumPy refuses; here NumPy takes them modulo 2**32."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def _processes(count: int) -> str:
    """``1 process``, ``2 processes``."""
    return f"{count} process" if count == 1 else f"{count} processes"


def _gather_rng(info: DistInfo) -> list:
    state = get_rng_state()
    if not info.distributed:
        return [state]
    states = [None] * info.world_size
    dist.all_gather_object(states, state)
    return states


class _Run:
    """The objects of one run and how to checkpoint them.

    ``init_weights``: load ``model.init_from`` (when set) into the fresh model before the optimizer and
    the EMA are built; False when resuming, whose checkpoint holds the weights.
    """

    def __init__(self, config: dict, info: DistInfo, run_dir: Path, init_weights: bool = True) -> None:
        self.config, self.info, self.run_dir = config, info, run_dir
        data, aug, optim = config["data"], config["aug"], config["optim"]
        _seed(config["seed"])
        name = config["model"]["name"]
        data_cfg = resolve_data_config({}, pretrained_cfg=timm.get_pretrained_cfg(name).to_dict())
        world, accum = info.world_size, optim["accum_steps"]
        batch = micro_batch_size(config, world)
        val_batch = max(1, (data["val_batch_size"] or data["batch_size"]) // world)
        loader_args = dict(num_workers=data["workers"], collate_fn=collate_skipping,
                           pin_memory=info.device.type == "cuda" if data["pin_memory"] is None else data["pin_memory"])
        if data["workers"]:
            loader_args.update(persistent_workers=data["persistent_workers"], prefetch_factor=data["prefetch_factor"])
        # The loader's generator seeds its workers; reseeded before every epoch (see ``epoch_loader``).
        self.generator = torch.Generator()
        if data["dataset"].lower().startswith("wds/"):  # a stream: it plans its own epochs (mhla/training/shards.py)
            train_set, val_set, num_classes = shard_datasets(data, aug, data_cfg, config["seed"], batch, info.rank)
            for stream in (train_set, val_set):
                stream.set_loader_cfg(data["workers"])
            self.sampler = train_set
            self.train_loader = DataLoader(train_set, batch_size=batch, generator=self.generator, **loader_args)
            self.val_loader = DataLoader(val_set, batch_size=val_batch, **loader_args)
        else:
            train_set, val_set, num_classes = build_datasets(data, aug, data_cfg, config["seed"])
            self.sampler = EpochSampler(len(train_set), batch, world, info.rank, config["seed"])
            self.train_loader = DataLoader(train_set, batch_size=batch, sampler=self.sampler,
                                           generator=self.generator, **loader_args)
            self.val_loader = DataLoader(Subset(val_set, shard_indices(len(val_set), world, info.rank)),
                                         batch_size=val_batch, shuffle=False, **loader_args)

        self.model = build_model(config, num_classes).to(info.device)
        if init_weights and config["model"]["init_from"] is not None:
            for notice in load_init_weights(self.model, config["model"]["init_from"]):
                self.note(f"model.init_from: {notice}")
        self.optimizer = build_optimizer(self.model, optim)
        updates_per_epoch = max(1, math.ceil(self.sampler.batches_per_epoch / accum))  # a short last group updates too
        self.scheduler = build_scheduler(self.optimizer, config, updates_per_epoch)
        self.ema = ModelEmaV3(self.model, decay=config["ema"]["decay"]) if config["ema"]["enabled"] else None
        self.mixup = None
        if aug["mixup"] > 0 or aug["cutmix"] > 0:
            self.mixup = Mixup(mixup_alpha=aug["mixup"], cutmix_alpha=aug["cutmix"], prob=aug["mixup_prob"],
                               switch_prob=aug["mixup_switch_prob"], label_smoothing=aug["label_smoothing"],
                               num_classes=num_classes)
            self.criterion = SoftTargetCrossEntropy()
        else:
            self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=aug["label_smoothing"])
        amp = config["amp"]
        use_amp = amp["enabled"] and info.device.type == "cuda"
        dtype = torch.bfloat16 if amp["dtype"] == "bfloat16" else torch.float16
        self.autocast = (functools.partial(torch.autocast, "cuda", dtype=dtype) if use_amp
                         else contextlib.nullcontext)
        self.scaler = torch.amp.GradScaler("cuda") if use_amp and dtype == torch.float16 else None
        self.train_model = self.model
        if info.distributed:
            self.train_model = DistributedDataParallel(
                self.model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
        if config["compile"] == "blocks":  # in place: training, evaluation and the DDP wrapper all run them
            compile_blocks(self.model)
        elif config["compile"]:
            self.train_model = torch.compile(self.train_model)
        self.state = TrainState()
        self.metrics = MetricsLog(run_dir)

    def note(self, message: str) -> None:
        """A one-line notice on stderr, from the main process."""
        if self.info.is_main:
            print(f"note: {message}", file=sys.stderr, flush=True)

    def epoch_loader(self) -> "_Batches":
        """The rest of the current epoch's training batches: from ``state.batch_in_epoch`` to the epoch's end."""
        self.sampler.set_epoch(self.state.epoch, start_batch=self.state.batch_in_epoch)
        self.generator.manual_seed(self.config["seed"])  # the same worker seeds every epoch, resumed or not
        return _Batches(self.train_loader, self.sampler.batches_per_epoch - self.state.batch_in_epoch)

    def state_dict(self, rng: list) -> dict:
        return {
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "state": dataclasses.asdict(self.state),
            "rng": rng,
            "model_name": self.config["model"]["name"],
            "config": {k: v for k, v in self.config.items() if not k.startswith("_")},
        }

    def load_state_dict(self, checkpoint: dict) -> None:
        """Continue from ``checkpoint``. Written by as many processes as this run has, every process takes its
        own RNG states back (bit-exact resume); else they are reseeded from (seed, step, rank), with a notice."""
        unwrap_model(self.model).load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if self.scaler is not None and checkpoint["scaler"] is not None:
            self.scaler.load_state_dict(checkpoint["scaler"])
        if self.ema is not None and checkpoint["ema"] is not None:
            self.ema.load_state_dict(checkpoint["ema"])
        self.state = TrainState(**checkpoint["state"])
        rng = checkpoint["rng"]
        if len(rng) == self.info.world_size:
            set_rng_state(rng[self.info.rank])
        else:
            self.note(f"resume: the checkpoint was written by {_processes(len(rng))}, this run has "
                      f"{_processes(self.info.world_size)}: the random generators are reseeded, so the run "
                      f"continues but not bit-exactly")
            _seed(self.config["seed"] + 1_000_003 * self.state.step + self.info.rank)

    def save(self, *names: str) -> None:
        """Write the current state once per name (every process takes part: the RNG gather is collective)."""
        rng = _gather_rng(self.info)
        if self.info.is_main:
            state = self.state_dict(rng)
            for name in names:
                save_atomic(state, self.run_dir / name)

    def on_step(self, state: TrainState) -> None:
        interval = self.config["checkpoint"]["interval_steps"]
        if interval and state.step % interval == 0 and state.batch_in_epoch < self.sampler.batches_per_epoch:
            self.save("last.pth")  # mid-epoch; the epoch's end saves anyway

    def epoch_end(self, epoch_time: float) -> dict:
        val = evaluate(self.train_model, self.val_loader, self.info, self.autocast)
        row = {"epoch": self.state.epoch, "step": self.state.step,
               "train_loss": self.state.loss_sum / max(self.state.samples, 1), "val_loss": val["loss"],
               "val_top1": val["top1"], "val_top5": val["top5"], "val_images": val["count"],
               "lr": self.optimizer.param_groups[0]["lr"], "epoch_time_s": epoch_time,
               "skipped_images": self.state.skipped, "unpaired_images": self.state.unpaired,
               "empty_batches": self.state.empty_batches, "val_skipped_images": val["skipped"]}
        if self.ema is not None:
            ema_val = evaluate(self.ema.module, self.val_loader, self.info, self.autocast)
            row.update(ema_val_top1=ema_val["top1"], ema_val_top5=ema_val["top5"])
        is_best = val["top1"] > self.state.best_top1
        if is_best:
            self.state.best_top1 = val["top1"]
        if self.info.is_main:
            self.metrics.write(row)
        epoch = self.state.epoch
        self.state = dataclasses.replace(self.state, epoch=epoch + 1, batch_in_epoch=0, loss_sum=0.0, samples=0,
                                         **dict.fromkeys(COUNTS, 0))
        keep = self.config["checkpoint"]["keep"]
        names = ["last.pth"] + (["best.pth"] if is_best else []) + ([f"epoch_{epoch:04d}.pth"] if keep else [])
        self.save(*names)
        if self.info.is_main and keep:
            for old in sorted(self.run_dir.glob("epoch_*.pth"))[:-keep]:
                old.unlink()
        return row


class _Batches:
    """The first ``count`` batches of ``loader``, with a length (a stream of shards yields a few more per epoch)."""

    def __init__(self, loader: DataLoader, count: int) -> None:
        self.loader, self.count = loader, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.count)


def run(config: dict, resume: str | None = None, argv: list[str] | None = None) -> list[dict]:
    """Train as ``config`` says (validated by ``mhla.training.config``); returns the epoch metrics rows."""
    info = init_distributed(config["device"])
    run_dir = Path(config["output_dir"]) / config["run_name"]
    resume_path = resolve_resume(resume, run_dir)
    checkpoint = load_checkpoint(resume_path) if resume_path is not None else None
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_info(run_dir, config, argv or sys.argv)
    trainer = _Run(config, info, run_dir, init_weights=checkpoint is None)
    if checkpoint is not None:
        trainer.load_state_dict(checkpoint)
    wandb_run = start_wandb(config, run_dir, trainer.state.wandb_id) if info.is_main else None
    if wandb_run is not None:
        trainer.state.wandb_id = wandb_run.id
    rows = []
    try:
        while trainer.state.epoch < config["epochs"]:
            loader = trainer.epoch_loader()
            start = time.perf_counter()
            train_one_epoch(
                trainer.train_model, loader, trainer.optimizer, trainer.scheduler, trainer.criterion,
                trainer.state, info, mixup=trainer.mixup, ema=trainer.ema, scaler=trainer.scaler,
                autocast=trainer.autocast, accum_steps=config["optim"]["accum_steps"],
                clip_grad=config["optim"]["clip_grad"], on_step=trainer.on_step,
                log_interval=config["log"]["interval"], checkpoint_interval=config["checkpoint"]["interval_steps"])
            row = trainer.epoch_end(time.perf_counter() - start)
            rows.append(row)
            if info.is_main:
                print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
            if wandb_run is not None:
                wandb_run.log(row, step=row["step"])
    finally:
        if wandb_run is not None:
            wandb_run.finish()
        if info.distributed and dist.is_initialized():
            dist.destroy_process_group()
    return rows
