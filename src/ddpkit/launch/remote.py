"""The commands a launcher sends to each host, as text for a remote shell.

One node script serves every node and both launchers (paramiko and the
rendered bash script): the node rank and the master address arrive as
DDPKIT_NODE_RANK / DDPKIT_MASTER_ADDR on the `env` prefix, so the only
per-node text is two shell-quoted words. Every value is shlex-quoted; only
the node-side variables of the rank contract expand remotely.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass

from ..contract import Arg, FromNode, Target, job_env, sources, torchrun_argv
from ..render import default_template_dir, environment
from ..spec import JobSpec

NODE_RANK = "DDPKIT_NODE_RANK"
MASTER_ADDR = "DDPKIT_MASTER_ADDR"
PGID = "DDPKIT_PGID"
PGID_PREFIX = f"{PGID}="


@dataclass(frozen=True)
class NodeCommand:
    """What to send to one host to start, and to stop, its part of the job."""

    start: str
    stop_template: str

    def stop(self, pgid: int) -> str:
        return f"env {PGID}={int(pgid)} {self.stop_template}"


def node_env(spec: JobSpec) -> dict[str, str]:
    env = job_env(spec)
    # Lines must reach the launcher as they are printed, not when a buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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
    for key in [*env, NODE_RANK]:
        argv += [Arg.of("-e"), Arg.of(key)]  # value comes from the exported environment
    if spec.ssh.workdir:
        argv += [Arg.of("-w"), Arg.of(spec.ssh.workdir)]
    return argv + [Arg.of(spec.image)]


def launch_argv(spec: JobSpec, *, doctor: bool = False) -> list[Arg]:
    src = dataclasses.replace(sources(spec, Target.SSH), master_addr=FromNode(MASTER_ADDR))
    argv = torchrun_argv(spec, src, doctor=doctor)
    if spec.ssh.docker:
        argv = docker_argv(spec, node_env(spec)) + argv
    return argv


def node_script(spec: JobSpec, *, doctor: bool = False, watch_stdin: bool = True) -> str:
    template = environment(default_template_dir()).get_template("ssh/node.sh.j2")
    return template.render(
        spec=spec,
        env=node_env(spec),
        workdir=None if spec.ssh.docker else spec.ssh.workdir,
        watch_stdin=watch_stdin,
        grace_s=spec.ssh.grace_s,
        grace_ticks=math.ceil(spec.ssh.grace_s * 10),
        argv=launch_argv(spec, doctor=doctor),
    )


def stop_script(spec: JobSpec) -> str:
    template = environment(default_template_dir()).get_template("ssh/stop.sh.j2")
    return template.render(
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


def start_payload(spec: JobSpec, *, doctor: bool = False, watch_stdin: bool = True) -> str:
    """The command after the env prefix. `setsid -w` gives the node its own
    process group (and waits for it, so the exit status comes back)."""
    script = node_script(spec, doctor=doctor, watch_stdin=watch_stdin)
    return f"setsid -w {BASH} -c {shlex.quote(script)} {shlex.quote('ddpkit-' + spec.name)}"


def stop_payload(spec: JobSpec) -> str:
    return f"{BASH} -c {shlex.quote(stop_script(spec))} ddpkit-stop"


def env_prefix(node_rank: int, master_addr: str) -> str:
    return f"env {NODE_RANK}={int(node_rank)} {MASTER_ADDR}={shlex.quote(master_addr)}"


def node_command(spec: JobSpec, node_rank: int, master_addr: str, *, doctor: bool = False) -> NodeCommand:
    prefix = env_prefix(node_rank, master_addr)
    return NodeCommand(
        start=f"{prefix} {start_payload(spec, doctor=doctor)}",
        stop_template=f"{NODE_RANK}={int(node_rank)} {stop_payload(spec)}",
    )


def parse_pgid(line: str) -> int | None:
    if line.startswith(PGID_PREFIX):
        value = line[len(PGID_PREFIX):].strip()
        if value.isdigit():
            return int(value)
    return None
