"""train_one_epoch: gradient accumulation over an epoch's short last group, lazy loss checks."""
import math

import pytest
import torch

from mhla.training.distributed import DistInfo
from mhla.training.engine import NonFiniteLossError, TrainState, train_one_epoch

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


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).double()


def run_epoch(model, loader, accum_steps, state=None, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = RecordingScheduler()
    state = state or TrainState()
    train_one_epoch(model, loader, optimizer, scheduler, torch.nn.functional.cross_entropy, state, INFO,
                    accum_steps=accum_steps, **kwargs)
    return scheduler, state


@pytest.mark.parametrize("count,accum_steps", [(5, 2), (7, 3), (4, 4), (3, 1)])
def test_every_group_is_one_update_and_no_gradient_outlives_the_epoch(count, accum_steps):
    model = tiny_model()
    scheduler, state = run_epoch(model, micro_batches(count), accum_steps)
    updates = math.ceil(count / accum_steps)
    assert scheduler.updates == list(range(1, updates + 1)) and state.step == updates
    assert state.batch_in_epoch == count
    assert all(p.grad is None for p in model.parameters())


def test_the_short_last_group_is_the_mean_of_its_own_micro_batches():
    batches = micro_batches(5)
    model = tiny_model()
    expected = tiny_model()
    run_epoch(model, batches, accum_steps=2)
    for group in (batches[0:2], batches[2:4], batches[4:5]):  # by hand: SGD on each group's mean loss
        expected.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(expected(x), y) for x, y, _ in group) / len(group)
        loss.backward()
        with torch.no_grad():
            for p in expected.parameters():
                p -= 0.5 * p.grad
    for actual, wanted in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


def test_a_resumed_epoch_groups_as_the_uninterrupted_one():
    batches = micro_batches(5)
    whole, resumed = tiny_model(), tiny_model()
    run_epoch(whole, batches, accum_steps=2)
    _, state = run_epoch(resumed, batches[:2], accum_steps=2)  # as if stopped after the first update
    state.batch_in_epoch = 2
    run_epoch(resumed, batches[2:], accum_steps=2, state=state)
    assert state.step == 3
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


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
