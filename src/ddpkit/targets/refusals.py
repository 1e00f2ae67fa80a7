"""Why a target cannot run a job, in one place: an elastic job where the
target has no elastic rendezvous (the contract's row says why), and mounts
the target cannot honour. Every target's build and every launcher calls
`refuse(spec, target)` before anything else, so a refused job is an input
error (exit 2) before any file is written or any process started."""

from __future__ import annotations

from ..contract import RowKey, elastic_refusal
from ..spec import JobSpec
from ..spec.yamlfile import SpecError
from . import mounts


def refusals(spec: JobSpec, target: RowKey) -> list[str]:
    """Each reason `target` refuses the job; empty when it can run it. The
    elastic refusal comes alone: without an elastic rendezvous nothing
    else can build the job's launch line to be checked."""
    elastic = elastic_refusal(spec, target)
    if elastic:
        return [elastic]
    mount = mounts.refusal(spec, target)
    return [mount] if mount else []


def refuse(spec: JobSpec, target: RowKey) -> None:
    """`refusals` raised as the input error targets and launchers report (exit 2)."""
    problems = refusals(spec, target)
    if problems:
        raise SpecError(problems)
