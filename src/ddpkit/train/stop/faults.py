"""Faults of a training job that every rank detects together and that end
the job with their own exit code (ddpkit.shared.exitcodes.ExitCode) and one line
naming the host, the path and the fix.

Each check gathers every rank's finding (agree()), so all ranks raise at the
same point instead of one rank exiting while the others wait in a collective
until its timeout.
"""

from __future__ import annotations

from ...shared.exitcodes import ExitCode


class TrainFault(RuntimeError):
    """A fault with its own exit code; str() is the one-line message."""

    exit_code: ExitCode = ExitCode.FAILED


class ResumeMismatch(TrainFault):
    exit_code = ExitCode.RESUME_MISMATCH


class CheckpointDirError(TrainFault):
    exit_code = ExitCode.CHECKPOINT_DIR


class DataMissing(TrainFault):
    exit_code = ExitCode.DATA_MISSING


def agree(problem: str | None, host: str, distributed: bool) -> list[tuple[int, str, str]]:
    """Every rank's (rank, host, problem) for the ranks that found one, on every rank.
    A collective: every rank must call it at the same point."""
    if not distributed:
        return [(0, host, problem)] if problem else []
    import torch.distributed as dist

    found: list[tuple[str, str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, (host, problem))
    return [(rank, h, p) for rank, item in enumerate(found) if item is not None
            for h, p in [item] if p]


def hosts_named(failures: list[tuple[int, str, str]]) -> str:
    """'host a (rank 1), host b (rank 3)': at most four, then a count."""
    named = [f"host {h} (rank {r})" for r, h, _ in failures[:4]]
    more = len(failures) - len(named)
    return ", ".join(named) + (f" and {more} more" if more else "")


def check_data(data: str, data_dir: object, problem: str | None, host: str, distributed: bool) -> None:
    """Every rank's --data-dir finding, agreed: raises DataMissing on every rank
    when the dataset is missing on any node."""
    failures = agree(problem, host, distributed)
    if failures:
        raise DataMissing(
            f"--data {data} --data-dir {data_dir} is missing on {hosts_named(failures)}: {failures[0][2]}; "
            "put the dataset at the same path on every node (or on a filesystem every node shares)"
            + (f", e.g. `ddpkit data cifar10 --root {data_dir}` on each node" if data == "cifar10" else ""))
