"""One training epoch and one evaluation pass (DeiT's ``engine.py``, on timm's components)."""
import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .distributed import DistInfo, all_reduce_sum

__all__ = ["NonFiniteLossError", "TrainState", "evaluate", "train_one_epoch"]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


@dataclass
class TrainState:
    """Where a run is, as stored in its checkpoints."""

    epoch: int = 0  # the epoch in progress (or next to start)
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed
    step: int = 0  # optimizer steps taken so far
    best_top1: float = -1.0
    loss_sum: float = 0.0  # training loss of this epoch so far, summed over samples of all processes
    samples: int = 0
    skipped: int = 0  # unreadable images skipped this epoch
    wandb_id: str | None = None


def _progress(iterable, total: int, desc: str, info: DistInfo):
    """A tqdm bar on the main process when stderr is a terminal; plain iteration otherwise."""
    if info.is_main and sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, leave=False)
    return iterable


def train_one_epoch(
        model: torch.nn.Module,
        loader,
        optimizer: torch.optim.Optimizer,
        scheduler,
        criterion: Callable,
        state: TrainState,
        info: DistInfo,
        *,
        mixup=None,
        ema=None,
        scaler=None,
        autocast=contextlib.nullcontext,
        accum_steps: int = 1,
        clip_grad: float | None = None,
        on_step: Callable[[TrainState], None] = lambda state: None,
        log_interval: int = 50,
) -> None:
    """Train over ``loader`` from ``state.batch_in_epoch``, updating ``state`` as it goes.

    ``on_step(state)`` runs after every optimizer step (the trainer saves mid-epoch checkpoints
    there). The scheduler steps per update (``step_update``). Raises ``NonFiniteLossError``.
    """
    model.train()
    total = state.batch_in_epoch + len(loader)
    bar = _progress(loader, len(loader), f"epoch {state.epoch}", info)
    start, seen = time.perf_counter(), 0
    for images, targets, skipped in bar:
        state.skipped += skipped
        images, targets = images.to(info.device, non_blocking=True), targets.to(info.device, non_blocking=True)
        if mixup is not None:
            images, targets = mixup(images, targets)
        last_micro = (state.batch_in_epoch + 1) % accum_steps == 0
        sync = contextlib.nullcontext() if last_micro or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast():
                loss = criterion(model(images), targets)
            if not math.isfinite(loss.item()):
                raise NonFiniteLossError(
                    f"loss is {loss.item()} at step {state.step + 1} (epoch {state.epoch}, batch "
                    f"{state.batch_in_epoch}); training stopped")
            scaled = loss / accum_steps
            if scaler is not None:
                scaler.scale(scaled).backward()
            else:
                scaled.backward()
        state.batch_in_epoch += 1
        batch_loss, batch_size = all_reduce_sum([loss.item() * images.shape[0], images.shape[0]], info)
        state.loss_sum += batch_loss
        state.samples += int(batch_size)
        seen += int(batch_size)
        if not last_micro:
            continue
        if scaler is not None:
            if clip_grad is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            scaler.step(optimizer)
            scaler.update()
        else:
            if clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        scheduler.step_update(state.step)
        if ema is not None:
            ema.update(model, step=state.step)
        lr = optimizer.param_groups[0]["lr"]
        if isinstance(bar, tqdm):
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}",
                            img_s=f"{seen / (time.perf_counter() - start):.0f}")
        elif info.is_main and state.step % log_interval == 0:
            print(f"epoch {state.epoch} batch {state.batch_in_epoch}/{total} step {state.step} "
                  f"loss {loss.item():.4f} lr {lr:.2e} img/s {seen / (time.perf_counter() - start):.0f}",
                  file=sys.stderr, flush=True)
        on_step(state)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, info: DistInfo, autocast=contextlib.nullcontext) -> dict:
    """Loss, top-1 and top-5 (percent) over every sample of ``loader`` on all processes, and their count."""
    model.eval()
    loss_sum, top1, top5, count = 0.0, 0.0, 0.0, 0
    for images, targets, _ in _progress(loader, len(loader), "eval", info):
        images, targets = images.to(info.device, non_blocking=True), targets.to(info.device, non_blocking=True)
        with autocast():
            logits = model(images)
        logits = logits.float()
        loss_sum += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        best = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = best == targets[:, None]
        top1 += hits[:, 0].sum().item()
        top5 += hits.any(dim=1).sum().item()
        count += targets.shape[0]
    loss_sum, top1, top5, count = all_reduce_sum([loss_sum, top1, top5, count], info)
    count = max(count, 1)
    return {"loss": loss_sum / count, "top1": 100 * top1 / count, "top5": 100 * top5 / count, "count": int(count)}
