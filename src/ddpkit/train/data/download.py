"""`ddpkit data cifar10 --root DIR`: fetch CIFAR-10 into DIR/cifar-10-batches-py
(torchvision's format, what `ddpkit train --data cifar10 --data-dir DIR` reads).

Inside a job, `prepare_once` downloads on local rank 0 of each node while the
other ranks wait at a barrier, so a shared or per-node folder is fetched once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=["cifar10"])
    parser.add_argument("--root", type=Path, required=True, help="folder to download into")


def have_cifar10(root: Path) -> bool:
    from .loaders import CIFAR_FOLDER, CIFAR_TEST, CIFAR_TRAIN

    return all((root / CIFAR_FOLDER / n).is_file() for n in CIFAR_TRAIN + CIFAR_TEST)


def download_cifar10(root: Path) -> None:
    """torchvision's downloader (checksums included); a no-op when the files are there."""
    if have_cifar10(root):
        return
    from torchvision.datasets import CIFAR10

    root.mkdir(parents=True, exist_ok=True)
    CIFAR10(str(root), train=True, download=True)


def prepare_once(root: Path, local_rank: int, distributed: bool) -> None:
    """One download per node: local rank 0 fetches, everyone meets at a barrier."""
    import torch.distributed as dist

    error: Exception | None = None
    if local_rank == 0:
        try:
            download_cifar10(root)
        except Exception as exc:
            error = exc
    if distributed:
        dist.barrier()
    if error is not None:
        raise error


def run(args: argparse.Namespace) -> int:
    try:
        download_cifar10(args.root)
    except OSError as exc:
        print(f"ddpkit data: could not download CIFAR-10 into {args.root}: {exc}", file=sys.stderr)
        return 1
    print(f"CIFAR-10 ready in {args.root}")
    return 0
