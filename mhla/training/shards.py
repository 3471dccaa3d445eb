"""WebDataset shards (timm's ``wds/`` reader) as a stream that a run can resume exactly.

timm's ``ReaderWds`` reads the shards a worker is given (by rank and worker), in an order shuffled
from ``seed + epoch``, and shuffles samples in a buffer from the worker's seed; it builds that
pipeline once per worker and lets its shuffle run on from epoch to epoch. ``ShardStream`` rebuilds
it at every epoch instead, so an epoch's stream depends on (seed, epoch, rank, worker) alone, and
augments the n-th sample of a worker's stream under a seed from (run seed, epoch, rank, worker, n).
A run resumed ``k`` batches into an epoch reads through the samples of those ``k`` batches again
(decoded, not augmented) and goes on where the stopped run was: the same batches, bit for bit, as
long as the world size, ``data.workers`` and the batch size are the same. The DataLoader must hand
out batches in order (its default) and seed its workers the same way every epoch, as the trainer
does (see ``mhla.training.trainer``).
"""
import multiprocessing

from torch.utils.data import IterableDataset, get_worker_info

from .data import _seeded

__all__ = ["ShardStream", "shard_datasets"]


class ShardStream(IterableDataset):
    """``(transform(image), label)`` from timm's ``ReaderWds``, deterministic per epoch; see the module doc.

    Args:
        reader: a ``timm.data.readers.reader_wds.ReaderWds`` (``timm.data.create_reader("wds/...")``).
        transform: a timm/torchvision transform.
        seed: run seed, for the per-sample augmentation seed.
        batch_size: the DataLoader's batch size (samples per batch of one process).
        rank: this process's rank (part of the sample seed).
    """

    def __init__(self, reader, transform, seed: int, batch_size: int, rank: int = 0) -> None:
        self.reader, self.transform, self.seed, self.batch_size, self.rank = reader, transform, seed, batch_size, rank
        self._epoch = multiprocessing.Value("q", 0)  # shared: persistent workers see the main process's values
        self._start_batch = multiprocessing.Value("q", 0)

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The epoch to read, and the batches of it (of this process) already trained; before iterating."""
        self._epoch.value, self._start_batch.value = epoch, start_batch
        self.reader.set_epoch(epoch)

    def set_loader_cfg(self, num_workers: int) -> None:
        """Tell the reader how many loader workers split the shards (before the DataLoader starts)."""
        self.reader.set_loader_cfg(num_workers=num_workers)

    @property
    def batches_per_epoch(self) -> int:
        """Batches of one process per epoch: the split's samples over whole global batches (as ``EpochSampler``)."""
        return self.reader.num_samples // (self.batch_size * self.reader.dist_num_replicas)

    def __len__(self) -> int:
        return len(self.reader)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start_batch = self._epoch.value, self._start_batch.value
        skip = len(range(worker, start_batch, workers)) * self.batch_size  # this worker's share of the trained batches
        self.reader.ds = None  # rebuilt from the seeds, not run on from the last epoch
        for position, (image, label) in enumerate(self.reader):
            if position < skip:
                continue
            with _seeded(hash((self.seed, epoch, self.rank, worker, position)) & 0x7FFF_FFFF_FFFF):
                yield self.transform(image), label


def shard_datasets(data: dict, aug: dict, model_cfg: dict, seed: int, batch_size: int,
                   rank: int = 0) -> tuple[ShardStream, ShardStream, int]:
    """Train and validation streams of ``data.dataset: wds/NAME`` (shards and ``_info.json`` in ``data.root``).

    Args:
        data, aug: the ``data`` and ``aug`` sections of a run config (``train_split``/``val_split``: split names
            in ``_info.json``, or brace patterns of shard files, default ``train`` and ``validation``).
        model_cfg: the model's data config (mean, std, crop_pct).
        seed: run seed; batch_size: samples per batch of one process; rank: this process's.

    Returns:
        The two streams and the class count (``data.num_classes``, else ``_info.json``'s ``num_classes``).
    """
    from timm.data import create_reader

    from .data import eval_transform, train_transform

    name, root = data["dataset"], str(data["root"])
    streams = []
    for training, split, default in ((True, data["train_split"], "train"), (False, data["val_split"], "validation")):
        reader = create_reader(name, root=root, split=split or default, is_training=training,
                               batch_size=batch_size, seed=seed)
        transform = (train_transform(data["img_size"], aug, model_cfg) if training else
                     eval_transform(data["img_size"], model_cfg, aug["crop_pct"], aug["interpolation"]))
        streams.append(ShardStream(reader, transform, seed, batch_size, rank))
    num_classes = data["num_classes"] or streams[0].reader.info.get("num_classes")
    if not num_classes:
        raise ValueError(f"the shards' info under {root} state no num_classes: set data.num_classes")
    return streams[0], streams[1], num_classes
