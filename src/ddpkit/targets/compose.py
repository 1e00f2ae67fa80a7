"""docker compose: one service per node, node0 the master, gloo on CPU.

Compose has no per-container shell, so each service gets its node rank
resolved into its own command at render time (service index = node rank)."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from ..contract import Target, controller_env, elastic_refusal, hosts_for, sources, target_env, torchrun_argv
from ..quoting import compose_unliteral
from ..render import OutputFile, Rendered, RenderError
from ..spec import JobSpec
from ..specfile import SpecError

NAME = "compose"
FILENAME = "compose.yaml"


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    environment: dict[str, str]
    restart: str | None = None  # compose's restart policy (elastic: a failed node comes back and rejoins)


def compose_env(spec: JobSpec) -> dict[str, str]:
    """The job env of every service (gloo: the contract row says so)."""
    return target_env(spec, Target.COMPOSE)


def services(spec: JobSpec, *, doctor: bool = False) -> list[Service]:
    argv = torchrun_argv(spec, sources(spec, Target.COMPOSE), doctor=doctor)
    out = []
    for index, host in enumerate(hosts_for(spec, Target.COMPOSE)):
        injected = controller_env(spec, Target.COMPOSE, index)
        out.append(Service(host, [a.resolve(injected) for a in argv], compose_env(spec) | injected,
                           elastic_restart(spec, index)))
    return out


def elastic_restart(spec: JobSpec, index: int) -> str | None:
    """Elastic: a node other than node0 (which holds the rendezvous store)
    that fails is restarted by compose, up to max_restarts times, and its
    agent rejoins at the survivors' next restart."""
    if spec.elastic is None or index == 0:
        return None
    return f"on-failure:{spec.elastic.max_restarts}"


def build(spec: JobSpec, *, doctor: bool = False) -> list[OutputFile]:
    refusal = elastic_refusal(spec, Target.COMPOSE)
    if refusal:
        raise SpecError([refusal])
    variables = {"spec": spec, "services": services(spec, doctor=doctor)}
    return [OutputFile(FILENAME, "compose/compose.yaml.j2", variables, "yaml")]


def _unescape(value: object) -> object:
    # Compose interpolates $VAR in the file; the template writes compose_literal.
    return compose_unliteral(value) if isinstance(value, str) else value


def verify(spec: JobSpec, rendered: Rendered, *, doctor: bool = False) -> None:
    doc = yaml.safe_load(rendered.files[FILENAME])
    for svc in services(spec, doctor=doctor):
        got = doc["services"][svc.name]
        command = [_unescape(c) for c in got["command"]]
        env = {k: _unescape(v) for k, v in got["environment"].items()}
        if (command != svc.command or env != svc.environment or got["image"] != spec.image
                or got.get("restart") != svc.restart):
            raise RenderError(f"{FILENAME}: service {svc.name} does not match the job spec")
