"""train_one_epoch: gradient accumulation over an epoch's short last group, lazy loss checks, batches left
short or empty by unreadable images."""
import math

import numpy as np
import pytest
import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

from mhla.training.distributed import DistInfo
from mhla.training.engine import EmptyBatchError, NonFiniteLossError, TrainState, train_one_epoch

INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class RecordingScheduler:
    def __init__(self) -> None:
        self.updates: list[int] = []

    def step_update(self, num_updates: int) -> None:
        self.updates.append(num_updates)


def micro_batches(count: int, size: int = 3) -> list:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 4, generator=generator, dtype=torch.float64),
             torch.randint(0, 2, (size,), generator=generator), 0) for _ in range(count)]


def empty_batch(skipped: int) -> tuple:
    """What ``collate_skipping`` gives for a batch of ``skipped`` unreadable images."""
    return torch.empty(0), torch.empty(0, dtype=torch.long), skipped


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).double()


def run_epoch(model, loader, accum_steps, state=None, criterion=torch.nn.functional.cross_entropy, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = RecordingScheduler()
    state = state or TrainState()
    train_one_epoch(model, loader, optimizer, scheduler, criterion, state, INFO, accum_steps=accum_steps, **kwargs)
    return scheduler, state


@pytest.mark.parametrize("count,accum_steps", [(5, 2), (7, 3), (4, 4), (3, 1)])
def test_every_group_is_one_update_and_no_gradient_outlives_the_epoch(count, accum_steps):
    model = tiny_model()
    scheduler, state = run_epoch(model, micro_batches(count), accum_steps)
    updates = math.ceil(count / accum_steps)
    assert scheduler.updates == list(range(1, updates + 1)) and state.step == updates
    assert state.batch_in_epoch == count
    assert all(p.grad is None for p in model.parameters())


def assert_sgd_on_group_means(model, expected, groups) -> None:
    """``model`` holds what SGD (lr 0.5) on each group's mean loss makes of ``expected``, done here by hand."""
    for group in groups:
        expected.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(expected(x), y) for x, y, _ in group) / len(group)
        loss.backward()
        with torch.no_grad():
            for p in expected.parameters():
                p -= 0.5 * p.grad
    for actual, wanted in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


def test_the_short_last_group_is_the_mean_of_its_own_micro_batches():
    batches = micro_batches(5)
    model = tiny_model()
    expected = tiny_model()
    run_epoch(model, batches, accum_steps=2)
    assert_sgd_on_group_means(model, expected, (batches[0:2], batches[2:4], batches[4:5]))


@pytest.mark.parametrize("empty_at", [None, 3], ids=["full", "empty-batch-3"])
def test_a_resumed_epoch_groups_as_the_uninterrupted_one(empty_at):
    batches = micro_batches(5)
    if empty_at is not None:
        batches[empty_at] = empty_batch(3)
    whole, resumed = tiny_model(), tiny_model()
    _, whole_state = run_epoch(whole, batches, accum_steps=2)
    _, state = run_epoch(resumed, batches[:2], accum_steps=2)  # as if stopped after the first update
    state.batch_in_epoch = 2
    run_epoch(resumed, batches[2:], accum_steps=2, state=state)
    counted = ("step", "batch_in_epoch", "samples", "skipped", "unpaired", "empty_batches")
    assert [getattr(state, name) for name in counted] == [getattr(whole_state, name) for name in counted]
    assert state.step == 3 and state.empty_batches == state.skipped // 3 == (empty_at is not None)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_mixup_drops_the_last_image_of_an_odd_batch_and_an_empty_batch_changes_nothing(capsys):
    """One image of micro-batch 1 unreadable, all of micro-batch 2: the epoch trains as on micro-batches 0, 1 without
    its last image and 3, yet takes four updates; the update of micro-batch 2 trains on nothing and says so."""
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=0.0, label_smoothing=0.0, num_classes=2)

    def batches(broken: bool) -> list:
        b0, (x1, y1, _), _, b3 = micro_batches(4, size=4)
        if broken:
            return [b0, (x1[:3], y1[:3], 1), empty_batch(4), b3]
        return [b0, (x1[:2], y1[:2], 0), b3]

    models, logged = {}, {}
    for broken in (False, True):
        np.random.seed(0)  # Mixup draws its mixing weights from NumPy
        models[broken] = tiny_model()
        scheduler, state = run_epoch(models[broken], batches(broken), accum_steps=1, mixup=mixup,
                                     criterion=SoftTargetCrossEntropy(), log_interval=1)
        logged[broken] = [line.split(" lr ")[0] for line in capsys.readouterr().err.splitlines()]
    assert scheduler.updates == [1, 2, 3, 4] and (state.step, state.batch_in_epoch) == (4, 4)
    assert (state.skipped, state.unpaired, state.empty_batches, state.samples) == (5, 1, 1, 10)
    for broken, kept in zip(models[True].parameters(), models[False].parameters(), strict=True):
        assert torch.equal(broken, kept)
    assert logged[True][2] == "epoch 0 batch 3/4 step 3 loss -"


def test_an_empty_micro_batch_leaves_its_group_the_mean_of_the_others():
    batches = micro_batches(4)
    batches[1] = empty_batch(3)
    model, expected = tiny_model(), tiny_model()
    _, state = run_epoch(model, batches, accum_steps=2)
    assert state.step == 2 and state.empty_batches == 1
    assert_sgd_on_group_means(model, expected, ([batches[0]], batches[2:4]))  # the micro-batches with images


def test_an_empty_micro_batch_stops_a_distributed_run_naming_it():
    info = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    model = tiny_model()
    with pytest.raises(EmptyBatchError, match=r"^epoch 0 batch 1: process 1 has no image of its micro-batch left "
                                              r"\(unreadable, or dropped to pair for mixup\)"):
        train_one_epoch(model, [micro_batches(1)[0], empty_batch(3)], torch.optim.SGD(model.parameters(), lr=0.5),
                        RecordingScheduler(), torch.nn.functional.cross_entropy, TrainState(), info, accum_steps=2)


def test_losses_are_summed_at_log_intervals_without_a_sync_per_micro_batch(monkeypatch):
    losses = []

    def criterion(logits, targets):
        loss = torch.nn.functional.cross_entropy(logits, targets)
        losses.append(loss.detach().clone())
        return loss

    syncs = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _f=original, _n=name: syncs.append(_n) or _f(self))
    state = TrainState()
    model = tiny_model()
    train_one_epoch(model, micro_batches(12), torch.optim.SGD(model.parameters(), lr=0.5), RecordingScheduler(),
                    criterion, state, INFO, accum_steps=2, log_interval=3)
    monkeypatch.undo()
    assert len(syncs) == 2  # after updates 3 and 6; the epoch end has nothing left to add
    assert state.samples == 36
    assert state.loss_sum == pytest.approx(3 * sum(loss.item() for loss in losses), rel=1e-12)


def test_a_non_finite_loss_names_the_step_where_it_appeared():
    batches = micro_batches(8)
    x, y, _ = batches[5]
    batches[5] = (torch.full_like(x, float("nan")), y, 0)  # micro-batch 5: update 3 with accum_steps=2
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 3 \(epoch 0, batch 5\); training stopped"):
        run_epoch(tiny_model(), batches, accum_steps=2, log_interval=4)


def test_a_checkpoint_step_holds_the_losses_so_far():
    seen = []
    model = tiny_model()
    run_epoch(model, micro_batches(6), accum_steps=1, log_interval=100, checkpoint_interval=2,
              on_step=lambda state: seen.append((state.step, state.samples)))
    assert seen == [(1, 0), (2, 6), (3, 6), (4, 12), (5, 12), (6, 18)]
