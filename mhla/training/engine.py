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

__all__ = ["EmptyBatchError", "NonFiniteLossError", "TrainState", "evaluate", "train_one_epoch"]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


class EmptyBatchError(RuntimeError):
    """A process of a distributed run has a micro-batch with no readable image; the message names it."""


@dataclass
class TrainState:
    """Where a run is, as stored in its checkpoints."""

    epoch: int = 0  # the epoch in progress (or next to start)
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed
    step: int = 0  # optimizer updates so far, those of groups with no image included (see train_one_epoch)
    best_top1: float = -1.0
    loss_sum: float = 0.0  # training loss of this epoch so far, summed over samples of all processes
    samples: int = 0
    # What this epoch left out so far, over all processes (see train_one_epoch):
    skipped: int = 0  # unreadable images
    unpaired: int = 0  # readable images dropped to give mixup an even batch
    empty_batches: int = 0  # micro-batches with no image left, not trained on
    wandb_id: str | None = None


COUNTS = ("skipped", "unpaired", "empty_batches")  # the TrainState counters _LossWindow sums over processes


def _progress(iterable, total: int, desc: str, info: DistInfo):
    """A tqdm bar on the main process when stderr is a terminal; plain iteration otherwise."""
    if info.is_main and sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, leave=False)
    return iterable


class _LossWindow:
    """Per-micro-batch losses kept on the device since the last ``flush``: one host sync per flush.

    ``flush`` sums them (with the sample counts and the ``COUNTS`` of left-out images and batches) over
    all processes into ``state`` and raises ``NonFiniteLossError`` if any was NaN or infinite, naming
    the first such micro-batch.
    """

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.losses: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.where: list[tuple[int, int, int]] = []  # (step, epoch, batch) of each micro-batch
        self.counts = dict.fromkeys(COUNTS, 0)

    def count(self, **left_out: int) -> None:
        """Add to the ``COUNTS`` (``skipped=``, ``unpaired=``, ``empty_batches=``)."""
        for name, value in left_out.items():
            self.counts[name] += value

    def add(self, loss: torch.Tensor, size: int, where: tuple[int, int, int]) -> None:
        self.losses.append(loss.detach())
        self.sizes.append(size)
        self.where.append(where)

    def flush(self, state: TrainState) -> float | None:
        """Add the window to ``state``; returns its mean loss over all processes (None if empty)."""
        # Alike on every process: in a distributed run each micro-batch has a loss (an empty one stops it).
        if not self.losses and not any(self.counts.values()):
            return None
        nothing = torch.zeros(0, dtype=torch.float64, device=self.info.device)
        losses = torch.stack(self.losses).double() if self.losses else nothing  # [n]
        sizes = torch.tensor(self.sizes, dtype=torch.float64, device=losses.device)
        finite = torch.isfinite(losses)
        counts = torch.tensor(list(self.counts.values()), dtype=torch.float64, device=losses.device)
        totals = torch.cat([torch.stack([(losses * sizes).sum(), sizes.sum(), (~finite).sum().double()]), counts])
        if self.info.distributed:
            dist.all_reduce(totals)
        loss_sum, samples, non_finite, *left_out = totals.tolist()
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
        for name, value in zip(COUNTS, left_out, strict=True):
            setattr(state, name, getattr(state, name) + int(value))
        self.losses, self.sizes, self.where = [], [], []
        self.counts = dict.fromkeys(COUNTS, 0)
        return loss_sum / max(samples, 1) if samples else None


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

    Unreadable images (``data.on_bad_image: skip``) leave micro-batches short, and ``collate_skipping``
    counts them. With ``mixup``, an odd micro-batch loses its last image (timm's ``Mixup`` pairs image i
    with image n - 1 - i and refuses an odd n): dropping one, rather than repeating one, gives no image
    twice the weight, and the choice depends on the batch alone, so a resumed run drops the same. A
    micro-batch with no image left is not trained on but is consumed all the same: ``batch_in_epoch``,
    the accumulation groups and so every ``step`` and the learning-rate schedule stay where the data
    position puts them, which keeps resume exact. A group's gradient is the mean over its micro-batches
    that held images; a group with none changes nothing (no optimizer, scaler or EMA step) but still
    counts as an update. What was left out is summed over processes into ``state`` (``skipped``,
    ``unpaired``, ``empty_batches``). With several processes an empty micro-batch stops the run with an
    ``EmptyBatchError``: leaving it out on one process alone would put the processes' gradient
    reductions out of step.
    """
    model.train()
    num_batches = state.batch_in_epoch + len(loader)  # micro-batches in the whole epoch
    window = _LossWindow(info)
    bar = _progress(loader, len(loader), f"epoch {state.epoch}", info)
    start, seen, trained = time.perf_counter(), 0, 0  # trained: micro-batches of this group with images
    for images, targets, skipped in bar:
        images, targets = _pair_for_mixup(images, targets, skipped, mixup is not None, window)
        group_start = state.batch_in_epoch - state.batch_in_epoch % accum_steps
        group_size = min(accum_steps, num_batches - group_start)
        need_update = state.batch_in_epoch + 1 == group_start + group_size
        if len(targets):
            images, targets = images.to(info.device, non_blocking=True), targets.to(info.device, non_blocking=True)
            if mixup is not None:
                images, targets = mixup(images, targets)
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
            trained += 1
            seen += images.shape[0] * info.world_size
        elif info.distributed:
            raise EmptyBatchError(f"epoch {state.epoch} batch {state.batch_in_epoch}: process {info.rank} has no "
                                  f"image of its micro-batch left (unreadable, or dropped to pair for mixup), and "
                                  f"with several processes a micro-batch cannot be left out on one alone: remove the "
                                  f"unreadable files or train on one process")
        else:
            window.count(empty_batches=1)
        state.batch_in_epoch += 1
        if not need_update:
            continue
        if trained:
            _update(model, optimizer, scaler, clip_grad, grad_scale=group_size / trained)
        state.step += 1
        scheduler.step_update(state.step)
        if trained and ema is not None:
            ema.update(model, step=state.step)
        trained = 0
        log_due = state.step % log_interval == 0
        if log_due or (checkpoint_interval and state.step % checkpoint_interval == 0):
            mean_loss = window.flush(state)
            if log_due:
                _log(bar, state, num_batches, mean_loss, optimizer.param_groups[0]["lr"],
                     seen / (time.perf_counter() - start), info)
        on_step(state)
    window.flush(state)


def _pair_for_mixup(images: torch.Tensor, targets: torch.Tensor, skipped: int, mixup: bool,
                    window: _LossWindow) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch without its last image if ``mixup`` and the count is odd; counts what was left out."""
    unpaired = int(mixup and len(targets) % 2)
    window.count(skipped=skipped, unpaired=unpaired)
    return (images[:-1], targets[:-1]) if unpaired else (images, targets)


def _update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler, clip_grad: float | None,
            grad_scale: float) -> None:
    """One optimizer step on the accumulated gradients, first multiplied by ``grad_scale`` (unless 1), then clipped
    to ``clip_grad``; the gradients are cleared after."""
    if grad_scale != 1:
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(grad_scale)
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


def _log(bar, state: TrainState, num_batches: int, loss: float | None, lr: float, img_s: float,
         info: DistInfo) -> None:
    """The mean loss since the last log (``-`` if nothing was trained on), on the progress bar or as a line on
    stderr (main process)."""
    loss_text = "-" if loss is None else f"{loss:.4f}"
    if isinstance(bar, tqdm):
        bar.set_postfix(loss=loss_text, lr=f"{lr:.2e}", img_s=f"{img_s:.0f}")
    elif info.is_main:
        print(f"epoch {state.epoch} batch {state.batch_in_epoch}/{num_batches} step {state.step} "
              f"loss {loss_text} lr {lr:.2e} img/s {img_s:.0f}", file=sys.stderr, flush=True)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, info: DistInfo, autocast=contextlib.nullcontext) -> dict:
    """Loss, top-1 and top-5 (percent) over every sample of ``loader`` on all processes, their count, and the
    count of unreadable images left out (``skipped``; a batch of them alone is not evaluated)."""
    model.eval()
    loss_sum, top1, top5, count, skipped = 0.0, 0.0, 0.0, 0, 0
    for images, targets, left_out in _progress(loader, len(loader), "eval", info):
        skipped += left_out
        if not len(targets):
            continue
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
    loss_sum, top1, top5, count, skipped = all_reduce_sum([loss_sum, top1, top5, count, skipped], info)
    total = max(count, 1)
    return {"loss": loss_sum / total, "top1": 100 * top1 / total, "top5": 100 * top5 / total, "count": int(count),
            "skipped": int(skipped)}
