"""SSH: a standalone bash launcher (`ddpkit render ssh`).

It sends each host the same node script as `ddpkit launch ssh` (with the
stdin watchdog off: a backgrounded `ssh` has no stdin to hold open), so the
two launchers run identical remote commands and differ only in who fans out.
"""

from __future__ import annotations

import math

from .. import records
from ..contract import RowKey
from ..render.engine import OutputFile, Rendered, RenderError
from ..render.quoting import first_shell_word
from ..shared.exitcodes import ExitCode
from ..spec import JobSpec
from . import mounts
from .refusals import refuse
from .sshnode import start_payload, stop_payload

NAME = "ssh"
FILENAME = "launch.sh"


def variables(spec: JobSpec) -> dict[str, object]:
    return {
        "spec": spec,
        "hosts": list(spec.ssh.hosts),
        "connect_timeout": max(1, round(spec.ssh.connect_timeout_s)),
        "interrupt_ticks": math.ceil(spec.grace.launcher_grace_s * 10),
        "alive_interval": max(1, round(spec.ssh.alive_interval_s)),
        "start_payload": start_payload(spec, watch_stdin=False),
        "stop_payload": stop_payload(spec),
        "worker_failed_at": records.stamped_frame_pattern(records.WorkerExit),
        "same_error": int(ExitCode.SAME_ERROR),  # an agent saw the same error twice: a bug; the run ends with it
    }


def build(spec: JobSpec) -> list[OutputFile]:
    refuse(spec, RowKey.SSH)
    warnings = mounts.container_warnings(spec, "ssh.docker") if spec.ssh.docker else []
    return [OutputFile(FILENAME, "ssh/launch.sh.j2", variables(spec), "shell", 0o755, notes=tuple(warnings))]


def _assigned_word(text: str, name: str) -> str | None:
    """The value of `NAME=<one shell word>` as bash would read it (the word
    may span lines: the node script is multi-line)."""
    marker = f"\n{name}="
    if marker not in text:
        return None
    return first_shell_word(text[text.index(marker) + len(marker):])


def verify(spec: JobSpec, rendered: Rendered) -> None:
    """The payloads must read back as exactly the commands the Python
    launcher sends, so the two launchers cannot drift apart."""
    text = rendered.files[FILENAME]
    expected = variables(spec)
    for name, key in (("NODE_PAYLOAD", "start_payload"), ("STOP_PAYLOAD", "stop_payload")):
        if _assigned_word(text, name) != expected[key]:
            raise RenderError(f"{FILENAME}: {name} does not match the job's remote command")
