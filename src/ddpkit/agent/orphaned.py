"""An elastic Slurm job whose batch host is lost: the other nodes end it.

Slurm runs the batch script on the allocation's first node, and in torchrun
mode that node's agent hosts the rendezvous store. When the node is lost
(its slurmd, the batch shell and its srun, the store), nothing is left to
end the job: an elastic job runs with `--no-kill`, so Slurm keeps the
allocation, and the other nodes' tasks have no srun to report to. It would
sit allocated and idle until its time limit.

The other nodes' agents are what is left. One that fails after its workers
had run (a rendezvous that had formed), in a Slurm job whose rendezvous
store no longer takes a connection and whose store host's slurmd does not
either (the node is gone, not only its agent: a batch shell that is still
there relaunches the step itself), asks Slurm to requeue the job
(`slurm.requeue` on: the requeued job starts on a new allocation and
resumes from its last checkpoint) or else cancels it, so the allocation is
freed at once. Both agents may ask; the second request changes nothing.
A request that fails is made again (a slurmctld busy with the lost node
times out), and what the agent says goes into the job's output file too:
the batch host's srun, which carried every node's lines there, is gone.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..host import scontrol
from ..shared import envnames

CONNECT_S = 5.0
ASK_TRIES, ASK_PAUSE_S = 4, 3.0
DEFAULT_SLURMD_PORT = 6818


def store_gone(endpoint: str) -> bool:
    """True when nothing takes a connection at endpoint (host:port)."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_S).close()
    except OSError:
        return True
    return False


def slurmd_port() -> int:
    """This cluster's SlurmdPort (`scontrol show config`), 6818 when it does not say."""
    try:
        done = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=False,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return DEFAULT_SLURMD_PORT
    port = scontrol.config_value(done.stdout, "SlurmdPort")
    return int(port) if port is not None and port.isdigit() else DEFAULT_SLURMD_PORT


def is_elastic(nnodes: str, env: Mapping[str, str] | None = None) -> bool:
    """A range on the launch line, or a batch shell that says the job is
    elastic: on Slurm the range's top is the step's node count, so a step
    on only min_nodes (a run Slurm gave no more, a relaunch) shows M:M."""
    low, _, high = str(nnodes).partition(":")
    return bool(high) and (low != high or bool((env or {}).get(envnames.DDPKIT_SLURM_BATCH_PID)))


def end_orphaned_job(args: Any, workers_ran: bool, env: Mapping[str, str]) -> bool:
    """Requeue or cancel this Slurm job when its rendezvous store is gone
    (see the module's doc); True when it asked Slurm to."""
    job = env.get(envnames.SLURM_JOB_ID)
    endpoint = getattr(args, "rdzv_endpoint", "") or ""
    if not job or not workers_ran or not is_elastic(getattr(args, "nnodes", ""), env) or not store_gone(endpoint):
        return False
    host = endpoint.rpartition(":")[0]
    if not store_gone(f"{host}:{slurmd_port()}"):
        return False  # the batch host is up (only its agent died): its batch script relaunches the step
    requeue = bool(env.get(envnames.DDPKIT_SLURM_REQUEUE_ON))
    command = ["scontrol", "requeue", job] if requeue else ["scancel", job]
    what = "requeueing it (its next run resumes from the last checkpoint)" if requeue else \
        "cancelling it (slurm.requeue is off)"
    output = job_output(job)
    tell(f"ddpkit.agent: the batch host {host} is gone (its rendezvous store and its slurmd do not answer), and "
         f"nothing there can end Slurm job {job}: {what}", output)
    why = ask_slurm(command)
    if why:
        tell(f"ddpkit.agent: {' '.join(command)} failed: {why}; end the job by hand (scancel {job})", output)
    return True


def ask_slurm(command: list[str]) -> str:
    """Run a Slurm command, again after a failure (a slurmctld busy with the
    lost node times out); what the last try said when every try failed, else ""."""
    why = ""
    for attempt in range(ASK_TRIES):
        if attempt:
            time.sleep(ASK_PAUSE_S)
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
        except FileNotFoundError as exc:  # no Slurm client on this host: no try will find one
            return str(exc)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
            continue
        if done.returncode == 0:
            return ""
        why = done.stderr.strip() or f"exit status {done.returncode}"
    return why


def job_output(job: str) -> Path | None:
    """The job's output file (`StdOut`), where its batch host's srun wrote
    every node's lines: with that srun gone, this node's own last words go
    there too (the file is opened for appending; none when Slurm does not say)."""
    try:
        done = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                              check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    output = scontrol.fields(done.stdout).get("StdOut")
    return None if output is None else Path(output)


def tell(line: str, output: Path | None) -> None:
    """A line in the job's output file and on this task's stderr. The file
    first: stderr's reader was the batch host's srun, and with it gone a
    write there can fail (a broken pipe) or go nowhere."""
    if output is not None:
        try:
            with output.open("a") as out:
                out.write(line + "\n")
        except OSError:
            pass  # not on a file system this node shares: stderr only
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass
