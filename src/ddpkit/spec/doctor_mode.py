"""Doctor mode as a transform of the job: the same nodes, rendezvous,
interface, images and launcher, running `ddpkit doctor` on every rank
instead of the job's command. The CLI and the launchers apply it once;
targets and the contract render the result like any other spec and never
learn that doctor mode exists."""

from __future__ import annotations

from .job import JobSpec
from .sections import Command

DOCTOR_MODULE = "ddpkit.doctor"


def doctor_mode(spec: JobSpec) -> JobSpec:
    """`spec` with its command replaced by the doctor (no trainer flags, so
    no checkpoint warnings and no global-batch flag: the doctor trains
    nothing)."""
    command = Command(module=DOCTOR_MODULE, python=spec.command.python)
    elastic = spec.elastic.model_copy(update={"keep_global_batch": False}) if spec.elastic else None
    return spec.model_copy(update={"command": command, "elastic": elastic})
