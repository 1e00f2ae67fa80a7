"""The tutorial script (tutorial_ddp.py), run as it is, with one rank's
checkpoint read in trouble, for the hang watchdog's start-up tests. Its own
flags come first, the tutorial's after them:

--stuck RANK:PATH    that rank loads its snapshot from PATH, a named pipe
                     nobody writes (a checkpoint on a hung filesystem): its
                     torch.load in the tutorial's _load_snapshot never returns
--slow RANK:SECONDS  that rank's torch.load first reads for SECONDS, a little
                     at a time (a slow filesystem that moves), then loads
--stuck-batch RANK:PATH  that rank's data loader reads its first batch from
                     PATH, a named pipe nobody writes: the batch never comes

The other ranks go on to DDP's broadcast of the parameters and wait there.
"""

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

import torch

TUTORIAL = Path(__file__).with_name("tutorial_ddp.py")


def read_slowly(path, seconds):
    """Reads the file again and again in small pieces for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with open(path, "rb") as fh:
            while fh.read(64) and time.monotonic() < deadline:
                time.sleep(0.05)


def first_batch_from(path):
    """A data loader fetch that reads `path` first (the map-style fetcher's `fetch`)."""

    def fetch_from_a_hung_filesystem(self, index):
        with open(path, "rb") as fh:
            fh.read()

    return fetch_from_a_hung_filesystem


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stuck", metavar="RANK:PATH")
    parser.add_argument("--slow", metavar="RANK:SECONDS")
    parser.add_argument("--stuck-batch", metavar="RANK:PATH")
    own, rest = parser.parse_known_args()
    rank = os.environ["RANK"]
    argv = [str(TUTORIAL), *rest]
    if own.stuck and own.stuck.split(":", 1)[0] == rank:
        argv += ["--snapshot", own.stuck.split(":", 1)[1]]
    if own.slow and own.slow.split(":", 1)[0] == rank:
        load, seconds = torch.load, float(own.slow.split(":", 1)[1])

        def slow_load(path, *args, **kwargs):
            read_slowly(path, seconds)
            return load(path, *args, **kwargs)

        torch.load = slow_load
    if own.stuck_batch and own.stuck_batch.split(":", 1)[0] == rank:
        from torch.utils.data._utils import fetch

        fetch._MapDatasetFetcher.fetch = first_batch_from(own.stuck_batch.split(":", 1)[1])
    sys.argv = argv
    runpy.run_path(str(TUTORIAL), run_name="__main__")


if __name__ == "__main__":
    main()
