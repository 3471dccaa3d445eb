"""One training epoch and one evaluation pass (DeiT's ``engine.py``, on timm's components)."""
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
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


class _LossWindow:
    """Per-micro-batch losses kept on the device since the last ``flush``: one host sync per flush.

    ``flush`` sums them (with the sample counts) over all processes into ``state`` and raises
    ``NonFiniteLossError`` if any was NaN or infinite, naming the first such micro-batch.
    """

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.losses: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.where: list[tuple[int, int, int]] = []  # (step, epoch, batch) of each micro-batch

    def add(self, loss: torch.Tensor, size: int, where: tuple[int, int, int]) -> None:
        self.losses.append(loss.detach())
        self.sizes.append(size)
        self.where.append(where)

    def flush(self, state: TrainState) -> float | None:
        """Add the window to ``state``; returns its mean loss over all processes (None if empty)."""
        if not self.losses:
            return None
        losses = torch.stack(self.losses).double()  # [n]
        sizes = torch.tensor(self.sizes, dtype=torch.float64, device=losses.device)
        finite = torch.isfinite(losses)
        totals = torch.stack([(losses * sizes).sum(), sizes.sum(), (~finite).sum().double()])
        if self.info.distributed:
            dist.all_reduce(totals)
        loss_sum, samples, non_finite = totals.tolist()
        if non_finite:
            local = (~finite).nonzero()
            if len(local):
                i = int(local[0])
                step, epoch, batch = self.where[i]
                found = f"loss is {losses[i].item()} at step {step} (epoch {epoch}, batch {batch})"
            else:
                found = (f"loss is not finite on another process between steps {self.where[0][0]} and "
                         f"{self.where[-1][0]}")
            raise NonFiniteLossError(f"{found}; training stopped")
        state.loss_sum += loss_sum
        state.samples += int(samples)
        self.losses, self.sizes, self.where = [], [], []
        return loss_sum / max(samples, 1)


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
        checkpoint_interval: int = 0,
) -> None:
    """Train over ``loader`` from ``state.batch_in_epoch``, updating ``state`` as it goes.

    Gradient accumulation as in timm: the epoch's micro-batches form groups of ``accum_steps``, the
    last group may be shorter, and each group is one optimizer update with its loss divided by the
    number of micro-batches in it. No gradient outlives the epoch, and an epoch of ``n`` micro-batches
    takes ``ceil(n / accum_steps)`` updates.

    Losses stay on the device: they are checked for NaN/inf and summed into ``state`` every
    ``log_interval`` updates, every ``checkpoint_interval`` updates (so that a checkpoint written by
    ``on_step`` holds them) and at the end of the epoch, not after every micro-batch (each check is a
    host sync). A non-finite loss therefore stops training within ``log_interval`` updates, with a
    ``NonFiniteLossError`` naming the step, epoch and batch where it first appeared.

    ``on_step(state)`` runs after every optimizer step (the trainer saves mid-epoch checkpoints
    there). The scheduler steps per update (``step_update``).
    """
    model.train()
    num_batches = state.batch_in_epoch + len(loader)  # micro-batches in the whole epoch
    window = _LossWindow(info)
    bar = _progress(loader, len(loader), f"epoch {state.epoch}", info)
    start, seen = time.perf_counter(), 0
    for images, targets, skipped in bar:
        state.skipped += skipped
        images, targets = images.to(info.device, non_blocking=True), targets.to(info.device, non_blocking=True)
        if mixup is not None:
            images, targets = mixup(images, targets)
        group_start = state.batch_in_epoch - state.batch_in_epoch % accum_steps
        group_size = min(accum_steps, num_batches - group_start)
        need_update = state.batch_in_epoch + 1 == group_start + group_size
        sync = contextlib.nullcontext() if need_update or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast():
                loss = criterion(model(images), targets)
            scaled = loss / group_size
            if scaler is not None:
                scaler.scale(scaled).backward()
            else:
                scaled.backward()
        window.add(loss, images.shape[0], (state.step + 1, state.epoch, state.batch_in_epoch))
        state.batch_in_epoch += 1
        seen += images.shape[0] * info.world_size
        if not need_update:
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
        log_due = state.step % log_interval == 0
        if log_due or (checkpoint_interval and state.step % checkpoint_interval == 0):
            mean_loss = window.flush(state)
            if log_due:
                _log(bar, state, num_batches, mean_loss, optimizer.param_groups[0]["lr"],
                     seen / (time.perf_counter() - start), info)
        on_step(state)
    window.flush(state)


def _log(bar, state: TrainState, num_batches: int, loss: float, lr: float, img_s: float, info: DistInfo) -> None:
    """The mean loss since the last log, on the progress bar or as a line on stderr (main process)."""
    if isinstance(bar, tqdm):
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", img_s=f"{img_s:.0f}")
    elif info.is_main:
        print(f"epoch {state.epoch} batch {state.batch_in_epoch}/{num_batches} step {state.step} "
              f"loss {loss:.4f} lr {lr:.2e} img/s {img_s:.0f}", file=sys.stderr, flush=True)


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
