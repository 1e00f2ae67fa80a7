"""What `submit slurm --follow` says about its job on stderr while the
Slurm backend streams the job's output (backends/slurm.py, the same lines
`ddpkit logs RUN --follow` prints): a line each time the job's state,
pending reason or restart count changes, the job given up (scancel) when
Slurm holds it for a reason waiting cannot clear, and its end after its
last output line. Its exit status is the job's: 0 for COMPLETED."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from ...shared.exitcodes import ExitCode
from .jobs import JobState


def _say(line: str) -> None:
    print(f"ddpkit: {line}", file=sys.stderr, flush=True)


@dataclass
class JobWatch:
    """One followed job's state as last listed, and what was said of it."""

    job_id: int
    last: JobState | None = None
    exit_status: int | None = None  # set once following has ended

    def seen(self, found: JobState | None) -> bool:
        """Whether to keep following, after saying what changed since the
        last poll. A job unknown at a poll keeps its last state (between
        squeue and sacct); one never known ends the follow."""
        if found is None:
            if self.last is None:
                _say(f"job {self.job_id} is unknown to squeue, sacct and scontrol")
                self.exit_status = ExitCode.FAILED
                return False
            return True
        self._announce(found)
        self.last = found
        if found.hopeless:
            self.exit_status = self._give_up(found)
            return False
        if found.finished:
            self.exit_status = found.exit_status
            return False
        return True

    def close(self) -> int:
        """The closing line, once the job's last output lines are out; the exit status."""
        last = self.last
        if last is not None and last.finished:
            _say(f"job {self.job_id} ended {last.state} (exit code {last.exit_code})")
        return ExitCode.FAILED if self.exit_status is None else self.exit_status

    def _announce(self, found: JobState) -> None:
        before = self.last
        if before is not None and (found.state, found.reason, found.restarts) == (before.state, before.reason,
                                                                                  before.restarts):
            return
        if before is not None and found.restarts > before.restarts:
            _say(f"job {self.job_id} was requeued (restart {found.restarts})")
        if found.state == "PENDING":
            _say(f"job {self.job_id} PENDING ({found.reason})")
        elif before is None or found.state != before.state:
            _say(f"job {self.job_id} {found.state}")

    def _give_up(self, found: JobState) -> int:
        """Cancel a job that can never start, rather than leave it queued forever."""
        subprocess.run(["scancel", str(self.job_id)], capture_output=True, check=False)
        _say(f"job {self.job_id} can never start: Slurm holds it with reason {found.reason} (it breaks a limit of"
             " its partition, QOS or account); cancelled it. Fix the request (nodes, time, account) or check it"
             " first without --no-check")
        return ExitCode.PREFLIGHT
