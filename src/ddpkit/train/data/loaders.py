"""Datasets, samplers and loaders.

Every random augmentation is seeded by (seed, epoch, sample index), never by a
global RNG, so a run resumed mid-epoch sees exactly the pixels the
uninterrupted run would have, whatever the number of loader workers.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from . import loader_procs

# One sample of every dataset here: a (C,H,W) image and its class index.
Sample = tuple[torch.Tensor, int]

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = ["test_batch"]
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class DataError(ValueError):
    """Data that cannot be loaded; the message names the flag and the fix."""


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    # one independent stream per (seed, epoch, sample): order- and worker-independent
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_000_007 + index)


def augment(image: torch.Tensor, gen: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop with zero padding and a random horizontal flip (C,H,W)."""
    _, h, w = image.shape
    padded = torch.nn.functional.pad(image, (pad, pad, pad, pad))
    dy, dx, flip = torch.randint(0, 2 * pad + 1, (2,), generator=gen).tolist() + [
        bool(torch.randint(0, 2, (1,), generator=gen))]
    out = padded[:, dy:dy + h, dx:dx + w]
    return out.flip(-1) if flip else out


class SyntheticImages(Dataset[Sample]):
    """Deterministic, learnable images of any shape: label i % classes, with a class-dependent mean."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int, split: int = 0) -> None:
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.seed = seed * 7919 + split  # train and test draw different images

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_000_007 + index)
        label = index % self.num_classes
        image = torch.randn(3, self.image_size, self.image_size, generator=gen) * 0.5
        image[label % 3] += (label + 1) / self.num_classes
        return image, label


class ArrayImages(Dataset[Sample]):
    """uint8 images (N,H,W,C) and labels in memory, normalised, augmented per (epoch, index) when training."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, train: bool, seed: int,
                 mean: tuple[float, ...] = CIFAR_MEAN, std: tuple[float, ...] = CIFAR_STD) -> None:
        self.images, self.labels, self.train, self.seed = images, labels, train, seed
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.item(index, epoch=0)

    def item(self, index: int, epoch: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(self.images[index]).permute(2, 0, 1).float().div_(255)
        image = (image - self.mean) / self.std
        if self.train:
            image = augment(image, sample_generator(self.seed, epoch, index))
        return image, int(self.labels[index])


def read_cifar10(root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's on-disk CIFAR-10 format: pickled dicts with b'data' (N,3072) and b'labels'."""
    folder = root / CIFAR_FOLDER
    names = CIFAR_TRAIN if train else CIFAR_TEST
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DataError(f"--data-dir {root}: {folder} lacks {', '.join(missing)}; "
                        f"run `ddpkit data cifar10 --root {root}` first")
    images, labels = [], []
    for name in names:
        with open(folder / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.extend(batch[b"labels"])
    return np.concatenate(images), np.asarray(labels, dtype=np.int64)


class FlipFolder(Dataset[Sample]):
    """ImageFolder with a deterministic per-(epoch, index) horizontal flip when training."""

    def __init__(self, root: Path, image_size: int, train: bool, seed: int) -> None:
        from torchvision import datasets, transforms

        tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                                 transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        self.inner = datasets.ImageFolder(str(root), transform=tf)
        self.train, self.seed = train, seed

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.item(index, epoch=0)

    def item(self, index: int, epoch: int) -> tuple[torch.Tensor, int]:
        image, label = self.inner[index]
        if self.train and bool(torch.randint(0, 2, (1,), generator=sample_generator(self.seed, epoch, index))):
            image = image.flip(-1)
        return image, label


def data_problem(data: str, data_dir: Path | None) -> str | None:
    """What is missing from --data-dir on this node, or None (synthetic data needs nothing)."""
    if data == "synthetic" or data_dir is None:
        return None
    if not data_dir.is_dir():
        return f"{data_dir}: no such directory"
    if data == "cifar10":
        folder = data_dir / CIFAR_FOLDER
        missing = [n for n in CIFAR_TRAIN + CIFAR_TEST if not (folder / n).is_file()]
        return f"{folder} lacks {', '.join(missing)}" if missing else None
    missing = [split for split in ("train", "val") if not (data_dir / split).is_dir()]
    return f"{data_dir} lacks {'/, '.join(missing)}/ (imagefolder needs train/<class>/<image> and val/...)" \
        if missing else None


def build_datasets(data: str, data_dir: Path | None, image_size: int, num_classes: int,
                   synthetic_size: int, eval_size: int, seed: int) -> tuple[Dataset[Sample], Dataset[Sample]]:
    if data == "synthetic":
        return (SyntheticImages(synthetic_size, image_size, num_classes, seed, split=0),
                SyntheticImages(eval_size, image_size, num_classes, seed, split=1))
    assert data_dir is not None
    if data == "cifar10":
        return (ArrayImages(*read_cifar10(data_dir, True), train=True, seed=seed),
                ArrayImages(*read_cifar10(data_dir, False), train=False, seed=seed))
    for split in ("train", "val"):
        if not (data_dir / split).is_dir():
            raise DataError(f"--data-dir {data_dir}: imagefolder needs {data_dir / split}/<class>/<image>")
    return (FlipFolder(data_dir / "train", image_size, True, seed), FlipFolder(data_dir / "val", image_size, False, seed))


def dataset_size(dataset: Dataset[Sample]) -> int:
    """len() of a map-style dataset (torch's Dataset type does not declare __len__)."""
    return len(cast(Sized, dataset))


class ResumableSampler(DistributedSampler[int]):
    """DistributedSampler that can start an epoch part-way, at a GLOBAL sample.

    An epoch's global order is one permutation of the dataset (seed + epoch,
    the same for any world size); with W ranks, rank r takes positions r,
    r+W, r+2W, ... of it, so after S steps of B samples per rank the job has
    consumed exactly positions 0 .. S*B*W-1. `set_epoch(e, start=G)` drops
    those G positions and deals the rest out to this world's ranks the same
    way, so a resumed run continues at the same global sample even when its
    world size (or batch) differs from the run that wrote the checkpoint.
    With the same world size this is exactly DistributedSampler's order minus
    the per-rank prefix. `skip=k` (per rank) means start=k*W.
    """

    def __init__(self, dataset: Dataset[Sample], num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.start = 0

    @property
    def skip(self) -> int:
        """Samples of this epoch each rank is taken to have trained on already."""
        return self.start // self.num_replicas

    def set_epoch(self, epoch: int, skip: int = 0, *, start: int | None = None) -> None:
        super().set_epoch(epoch)
        self.start = skip * self.num_replicas if start is None else start

    def global_order(self) -> list[int]:
        """The epoch's permutation, as DistributedSampler draws it."""
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        return torch.randperm(dataset_size(self.dataset), generator=gen).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        rest = order[self.start:]
        pad = -len(rest) % self.num_replicas  # equal shares, wrapping around as DistributedSampler does
        while pad:
            rest += order[:pad]
            pad = -len(rest) % self.num_replicas
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return max(0, -(-(dataset_size(self.dataset) - self.start) // self.num_replicas))


class ShardSampler(Sampler[int]):
    """Every index exactly once over all ranks (rank r gets r, r+W, ...): no padding,
    so evaluation never counts a sample twice."""

    def __init__(self, size: int, num_replicas: int, rank: int) -> None:
        self.size, self.num_replicas, self.rank = size, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.num_replicas))


@dataclass
class DeviceResidentLoader:
    """The whole (small) training set as one tensor on the device; batches are
    gathered by index there and augmented as a batch, seeded by the batch's
    position, so no host-to-device copy or worker process runs per step."""

    images: torch.Tensor   # (N,C,H,W) float, already normalised, on the device
    labels: torch.Tensor   # (N,) on the device
    sampler: ResumableSampler
    batch_size: int
    seed: int
    pad: int = 4

    @classmethod
    def from_dataset(cls, dataset: Dataset[Sample], sampler: ResumableSampler, batch_size: int, seed: int,
                     device: torch.device) -> DeviceResidentLoader:
        was_train = getattr(dataset, "train", None)
        if was_train is not None:
            setattr(dataset, "train", False)  # noqa: B010  store un-augmented pixels; augmentation happens per batch
        pairs = [dataset[i] for i in range(dataset_size(dataset))]
        if was_train is not None:
            setattr(dataset, "train", was_train)  # noqa: B010
        images = torch.stack([p[0] for p in pairs]).to(device)
        labels = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        return cls(images, labels, sampler, batch_size, seed)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler), dtype=torch.long, device=self.images.device)
        first = self.sampler.skip // self.batch_size  # batch number within the epoch, for seeding
        for b in range(len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            gen = sample_generator(self.seed, self.sampler.epoch, (first + b) * self.sampler.num_replicas + self.sampler.rank)
            yield self._augment(self.images[idx], gen), self.labels[idx]

    def _augment(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        n, _, h, w = x.shape
        if x.device.type != "cpu":
            # draw on the device: a copy from pageable host memory may wait for
            # the stream, i.e. for the previous step, every batch
            gen = torch.Generator(device=x.device).manual_seed(gen.initial_seed())
        shifts = torch.randint(0, 2 * self.pad + 1, (n, 2), generator=gen, device=x.device)
        flips = torch.randint(0, 2, (n,), generator=gen, device=x.device).bool()
        padded = torch.nn.functional.pad(x, (self.pad,) * 4)
        rows = (torch.arange(h, device=x.device)[None, :] + shifts[:, :1])  # (n,h)
        cols = (torch.arange(w, device=x.device)[None, :] + shifts[:, 1:])  # (n,w)
        cols = torch.where(flips[:, None], cols.flip(-1), cols)
        out = padded[torch.arange(n, device=x.device)[:, None, None, None],
                     torch.arange(x.shape[1], device=x.device)[None, :, None, None],
                     rows[:, None, :, None], cols[:, None, None, :]]
        return out


@runtime_checkable
class EpochItems(Protocol):
    """A dataset whose training items depend on the epoch (its augmentation seeds)."""

    def item(self, index: int, epoch: int) -> Sample: ...


class EpochTagged(Sampler[tuple[int, int]]):
    """The sampler's indices, each with the epoch it belongs to.

    The epoch travels with every index to the loader workers, which keep their
    own copy of the dataset for the whole run (persistent workers): a
    set_epoch on the rank's copy would never reach them."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class ByEpoch(Dataset[Sample]):
    """`dataset`, indexed by (epoch, index): what EpochTagged yields."""

    def __init__(self, dataset: Dataset[Sample]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return dataset_size(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Sample:
        epoch, index = key
        if isinstance(self.dataset, EpochItems):
            return self.dataset.item(index, epoch)
        return self.dataset[index]


def _preload(dataset: Dataset[Sample]) -> list[str]:
    """What a loader worker needs imported to unpickle `dataset` (torch comes with any of them)."""
    modules = [__name__, type(dataset).__module__]
    if isinstance(dataset, FlipFolder):
        modules.append("torchvision.datasets")  # ImageFolder: seconds per worker if not preloaded
    return list(dict.fromkeys(modules))


def _workers(dataset: Dataset[Sample], workers: int) -> dict[str, Any]:
    """The DataLoader's worker arguments: from the fork server, for the whole
    run (train/data/loader_procs.py says why). Persistent: a worker receives the
    dataset pickled, 150 MB for CIFAR-10, so once per epoch would cost seconds."""
    if workers == 0:
        return {"num_workers": 0}
    return {"num_workers": workers, "persistent_workers": True, "worker_init_fn": loader_procs.worker_init,
            "multiprocessing_context": loader_procs.worker_context(_preload(dataset))}


def train_loader(dataset: Dataset[Sample], sampler: ResumableSampler, batch_size: int, workers: int,
                 pin: bool) -> DataLoader[Sample]:
    # drop_last: every rank runs the same number of steps, so collectives stay matched
    return DataLoader(ByEpoch(dataset), batch_size=batch_size, sampler=EpochTagged(sampler), drop_last=True,
                      pin_memory=pin, **_workers(dataset, workers))


def eval_loader(dataset: Dataset[Sample], num_replicas: int, rank: int, batch_size: int, workers: int) -> DataLoader[Sample]:
    return DataLoader(dataset, batch_size=batch_size, sampler=ShardSampler(dataset_size(dataset), num_replicas, rank),
                      **_workers(dataset, workers))
