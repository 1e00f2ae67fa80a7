"""Where a line of a job's output came from, read from the tags ddpkit asks
for on every launch line: torchrun's rank tag (the template the launchers
pass, `RANK_TAG_FLAG`: `[rank3]:text`) and srun's task label (`--label`:
`  3: text`, the task id right-aligned). The one reader of both, for the
launchers' console, `submit slurm --follow` and `ddpkit logs`; and where a
tag starts inside a line another writer's line was glued to."""

from __future__ import annotations

RANK_TAG_OPEN, RANK_TAG_CLOSE = "[rank", "]:"
# What launchers pass torchrun so that each worker line starts with its global rank.
RANK_TAG_FLAG = f"--log-line-prefix-template={RANK_TAG_OPEN}${{rank}}{RANK_TAG_CLOSE}"


def rank_tagged(line: str) -> tuple[int, str] | None:
    """(rank, the worker's text) for a line torchrun tagged, else None."""
    if not line.startswith(RANK_TAG_OPEN):
        return None
    rank, closed, text = line[len(RANK_TAG_OPEN):].partition(RANK_TAG_CLOSE)
    return (int(rank), text) if closed and rank.isdecimal() else None


def tag_starts(line: str) -> list[int]:
    """Where a rank tag starts in `line` after its beginning: another writer's
    line glued to an unfinished one (torch's tagged warning after a bar)."""
    found, at = [], line.find(RANK_TAG_OPEN, 1)
    while at > 0:
        if rank_tagged(line[at:]) is not None:
            found.append(at)
        at = line.find(RANK_TAG_OPEN, at + 1)
    return found


def is_bare_tag(text: str) -> bool:
    """`text` is a rank tag and nothing else (torchrun's tag before a record's frame)."""
    tagged = rank_tagged(text)
    return tagged is not None and tagged[1] == ""


def task_labelled(line: str) -> tuple[int, str] | None:
    """(task, the task's text) for a line srun labelled, else None (the batch shell's own)."""
    task, colon, text = line.lstrip(" \t").partition(":")
    if not colon or not task.isdecimal():
        return None
    return int(task), text.removeprefix(" ")
