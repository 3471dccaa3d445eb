"""Datasets, per-sample seeded augmentation and the resumable sampler."""
import numpy as np
import pytest
import torch
from timm.data import create_transform

from mhla.training.data import AugmentedDataset, EpochSampler, MNIST5k, collate_skipping, shard_indices


@pytest.mark.slow  # reads and splits all 5,000 digits
def test_mnist5k_is_real_and_split_once():
    train, val = MNIST5k(train=True), MNIST5k(train=False)
    assert (len(train), len(val)) == (4000, 1000)
    assert sorted(set(train.targets)) == list(range(10)) and sorted(set(val.targets)) == list(range(10))
    image, label = val[0]
    assert image.size == (28, 28) and image.mode == "RGB"
    again = MNIST5k(train=False)
    assert again.targets == val.targets and np.array_equal(again.images, val.images)
    train_rows = {row.tobytes() for row in train.images}
    assert not any(row.tobytes() in train_rows for row in val.images)  # disjoint


def test_augmentation_depends_on_seed_epoch_and_index_only():
    transform = create_transform(28, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.5)
    data = AugmentedDataset(MNIST5k(train=False), transform, seed=1)
    first = data[5][0]
    torch.manual_seed(123)  # the global RNG does not matter
    np.random.seed(7)
    assert torch.equal(data[5][0], first)
    state = torch.get_rng_state()
    data[6]
    assert torch.equal(torch.get_rng_state(), state)  # nor is it consumed
    assert torch.equal(data[0, 5][0], first)  # (epoch, index), as EpochSampler hands them out
    data.epoch = 1
    assert not torch.equal(data[5][0], first)
    assert torch.equal(data[1, 5][0], data[5][0]) and torch.equal(data[0, 5][0], first)


@pytest.mark.parametrize("world", [2, 3])
def test_epoch_sampler_gives_every_world_size_the_same_global_batches(world):
    single = EpochSampler(50, batch_size=world * 4, num_replicas=1, seed=5)
    ranks = [EpochSampler(50, batch_size=4, num_replicas=world, rank=r, seed=5) for r in range(world)]
    for sampler in [single, *ranks]:
        sampler.set_epoch(2)
    assert {epoch for epoch, _ in single} == {2}  # each index comes with its epoch
    order = [index for _, index in single]
    per_rank = [[index for _, index in s] for s in ranks]
    assert single.batches_per_epoch == ranks[0].batches_per_epoch == 50 // (world * 4)
    for t in range(single.batches_per_epoch):
        together = sorted(i for r in per_rank for i in r[t * 4:(t + 1) * 4])
        assert together == sorted(order[t * world * 4:(t + 1) * world * 4])
    single.set_epoch(3)
    assert [index for _, index in single] != order  # a new shuffle every epoch


def test_epoch_sampler_starts_mid_epoch():
    sampler = EpochSampler(40, batch_size=4, seed=0)
    sampler.set_epoch(1)
    full = list(sampler)
    sampler.set_epoch(1, start_batch=3)
    assert list(sampler) == full[12:] and len(sampler) == len(full) - 12


def test_shards_cover_every_index_once():
    shards = [shard_indices(10, 3, r) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(10))


def test_collate_leaves_out_skipped_images():
    images, labels, skipped = collate_skipping([(torch.zeros(3, 2, 2), 1), None, (torch.ones(3, 2, 2), 2)])
    assert images.shape == (2, 3, 2, 2) and labels.tolist() == [1, 2] and skipped == 1


def test_randaugment_at_its_largest_magnitude_runs():
    """rand-m9-mstd0.5 reaches magnitude 10, where timm's PosterizeIncreasing keeps 0 bits: Pillow 13 refuses
    that (about 0.2% of samples, a crash within the first batches of an ImageNet run), Pillow < 13 blacks the
    image out."""
    from PIL import Image
    from timm.data.auto_augment import AugmentOp

    image = Image.new("RGB", (8, 8), (200, 100, 50))
    posterized = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)(image)
    assert posterized.getpixel((0, 0)) == (0, 0, 0)
