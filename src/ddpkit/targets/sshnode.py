"""The SSH node payload: the commands sent to each host, as text for a
remote shell. A target artefact: `ddpkit render ssh` (targets/ssh.py) embeds
it in launch.sh, and `ddpkit launch ssh` sends it over paramiko.

One node script serves every node and both launchers: the node rank and the
master address arrive as DDPKIT_NODE_RANK / DDPKIT_MASTER_ADDR on the `env`
prefix (an elastic job adds DDPKIT_RDZV_ID, fresh per run), so the only
per-node text is a few shell-quoted words. Every value is
quoted by ddpkit.render.quoting; only the node-side variables of the rank contract
expand remotely. The values of `secrets:` are on no command line: the script
reads them from its stdin, where each launcher writes them (launch ssh after
the preflight's GO, launch.sh from its own environment), and after them the
run key (runkey.py), which each launcher makes fresh for every run.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from ..contract import Arg, FromNode, LaunchPlan, RowKey, resolve
from ..render.engine import shell_argv, template
from ..render.quoting import bash_c, shell_word
from ..rendezvous import runkey
from ..shared import envnames
from ..shared.agreed import METRICS_TO_LAUNCHER
from ..spec import JobSpec
from . import mounts
from .limits import limits

NODE_RANK = envnames.DDPKIT_NODE_RANK
MASTER_ADDR = envnames.DDPKIT_MASTER_ADDR
RDZV_ID = envnames.DDPKIT_RDZV_ID
PGID = envnames.DDPKIT_PGID
PGID_PREFIX = f"{PGID}="


@dataclass(frozen=True)
class NodeCommand:
    """What to send to one host to start, and to stop, its part of the job:
    the start is the node's env prefix (env_prefix) and the payload every
    node shares."""

    prefix: str
    payload: str
    stop_template: str

    @property
    def start(self) -> str:
        return f"{self.prefix} {self.payload}"

    def stop(self, pgid: int, grace_s: float | None = None) -> str:
        """The stop command; `grace_s` replaces ssh.grace_s (an interrupt's longer grace)."""
        ticks = "" if grace_s is None else f" {envnames.DDPKIT_STOP_TICKS}={math.ceil(grace_s * 10)}"
        return f"env {PGID}={int(pgid)}{ticks} {self.stop_template}"


def launch_plan(spec: JobSpec) -> LaunchPlan:
    """The contract on SSH hosts: the launcher hands each node the master's
    address in its env prefix (env_prefix), so the line reads it there."""
    return resolve(spec, RowKey.SSH, master_addr=FromNode(MASTER_ADDR))


def node_env(spec: JobSpec) -> dict[str, str]:
    """The job environment every node exports (contract.target_env)."""
    return launch_plan(spec).env


def container_name(spec: JobSpec) -> Arg:
    return Arg.of(f"ddpkit-{spec.name}-node", FromNode(NODE_RANK))


def docker_argv(spec: JobSpec, env: dict[str, str]) -> list[Arg]:
    """`docker run` around the launch line: host network and IPC so NCCL and
    Gloo see the real interfaces and shared memory; a name so teardown can
    remove the container even when the client was killed."""
    argv = [Arg.of("docker"), Arg.of("run"), Arg.of("--rm"), Arg.of("--name=", *container_name(spec).parts)]
    if spec.device == "cuda":
        argv += [Arg.of("--gpus"), Arg.of("all")]
    argv += [Arg.of("--network"), Arg.of("host"), Arg.of("--ipc"), Arg.of("host")]
    lim = limits(spec)  # /dev/shm is the host's (--ipc host): only CPUs and memory apply
    if lim.cpus is not None:
        argv.append(Arg.of(f"--cpus={lim.cpus:g}"))
    if lim.memory is not None:
        argv.append(Arg.of(f"--memory={lim.memory}"))
    for key in [*env, *stdin_names(spec), NODE_RANK, *([RDZV_ID] if spec.elastic else [])]:
        argv += [Arg.of("-e"), Arg.of(key)]  # value comes from the exported environment
    for bind in mounts.binds(spec):
        argv += [Arg.of("-v"), Arg.of(bind)]
    if spec.ssh.workdir:
        argv += [Arg.of("-w"), Arg.of(spec.ssh.workdir)]
    return argv + [Arg.of(spec.image)]


def launch_argv(spec: JobSpec, plan: LaunchPlan | None = None) -> list[Arg]:
    """The torchrun line, in the job's container where ssh.docker says so
    (`plan`: the job's launch_plan, where the caller has it already)."""
    plan = plan or launch_plan(spec)
    return docker_argv(spec, plan.env) + plan.argv if spec.ssh.docker else plan.argv


def stdin_names(spec: JobSpec) -> list[str]:
    """The variables the node script reads from its stdin, in order: the
    secrets, then the run key (launch.secrets.with_run_key)."""
    return [*spec.secret_names, runkey.ENV]


def node_script(spec: JobSpec, *, watch_stdin: bool = True) -> str:
    plan = launch_plan(spec)
    return template("ssh/node.sh.j2").render(
        spec=spec,
        env=plan.env,
        secrets=stdin_names(spec),
        workdir=None if spec.ssh.docker else spec.ssh.workdir,
        watch_stdin=watch_stdin,
        grace_s=spec.ssh.grace_s,
        grace_ticks=math.ceil(spec.ssh.grace_s * 10),
        argv=launch_argv(spec, plan),
    )


def stop_script(spec: JobSpec) -> str:
    return template("ssh/stop.sh.j2").render(
        spec=spec,
        grace_s=spec.ssh.grace_s,
        grace_ticks=math.ceil(spec.ssh.grace_s * 10),
        container=container_name(spec) if spec.ssh.docker else None,
    )


# bash sources ~/.bashrc for a `-c` command when it believes sshd started it
# (SSH_CLIENT set, SHLVL < 2), which is the case here because the login shell
# execs its last command and lowers SHLVL first. The login shell has already
# run the rc files and exported their environment; running them again costs
# every node its rc's start-up time (pyenv, conda init, module loads) and may
# change PATH under the job. --norc turns that second run off.
BASH = "bash --norc"


def start_payload(spec: JobSpec, *, watch_stdin: bool = True) -> str:
    """The command after the env prefix. `setsid -w` gives the node its own
    process group (and waits for it, so the exit status comes back)."""
    script = node_script(spec, watch_stdin=watch_stdin)
    return "setsid -w " + bash_c(script, f"ddpkit-{spec.name}", bash=BASH)


def stop_payload(spec: JobSpec) -> str:
    return bash_c(stop_script(spec), "ddpkit-stop", bash=BASH)


def env_prefix(node_rank: int, master_addr: str, rdzv_id: str | None = None, metrics: bool = False) -> str:
    """`metrics`: a program of the user's own frames its metrics records on
    stderr for the launcher that reads the node's output (launch ssh)."""
    prefix = f"env {NODE_RANK}={int(node_rank)} {MASTER_ADDR}={shell_word(master_addr)}"
    if rdzv_id is not None:
        prefix += f" {RDZV_ID}={shell_word(rdzv_id)}"
    return f"{prefix} {envnames.DDPKIT_METRICS}={shell_word(METRICS_TO_LAUNCHER)}" if metrics else prefix


def new_rdzv_id(spec: JobSpec) -> str | None:
    """A fresh rendezvous id for one run of an elastic job (None: not
    elastic): agents of an earlier run that still linger on a host can
    never join this run's rendezvous."""
    if spec.elastic is None:
        return None
    return f"{spec.name}-{secrets.token_hex(6)}"


def launch_line(spec: JobSpec, node_rank: int, master_addr: str, *,
                rdzv_id: str | None = None) -> str:
    """The node's launch line as a person reads it (the env prefix and the
    torchrun line, without the process-group and clean-up shell around it)."""
    return f"{env_prefix(node_rank, master_addr, rdzv_id)} {shell_argv(launch_argv(spec))}"


def node_command(spec: JobSpec, node_rank: int, master_addr: str, *,
                 rdzv_id: str | None = None, metrics: bool = False) -> NodeCommand:
    """rdzv_id: the run's id (new_rdzv_id), the same on every node; required
    for an elastic job. metrics: see env_prefix."""
    if spec.elastic is not None and rdzv_id is None:
        raise ValueError("an elastic job needs the run's rendezvous id on every node (new_rdzv_id)")
    return NodeCommand(
        prefix=env_prefix(node_rank, master_addr, rdzv_id, metrics),
        payload=start_payload(spec),
        stop_template=f"{NODE_RANK}={int(node_rank)} {stop_payload(spec)}",
    )


def parse_pgid(line: str) -> int | None:
    if line.startswith(PGID_PREFIX):
        value = line[len(PGID_PREFIX):].strip()
        if value.isdigit():
            return int(value)
    return None
