"""`ddpkit launch docker`: N containers of the job's image act as N nodes.

Same rank contract as docker compose (contract.torchrun_argv with
Target.COMPOSE sources): container i is reachable as `node<i>` on a
user-defined network made for this run, gets DDPKIT_NODE_RANK=i, and node0
hosts the rendezvous. Output is streamed live with a `[nodeI]` prefix. Fail
fast: the first container that exits non-zero stops the others; every
container and the network are removed at the end, after Ctrl-C too.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..contract import Target, controller_env, hosts_for, job_env, sources, torchrun_argv
from ..exitcodes import ExitCode
from ..spec import Command, JobSpec
from ..specfile import add_spec_arguments, spec_from_args
from .interrupt import interrupts_raise

EXIT_BAD_INPUT = ExitCode.BAD_INPUT

if TYPE_CHECKING:
    import docker
    from docker.models.containers import Container

LABEL_JOB = "io.ddpkit.job"
LABEL_RUN = "io.ddpkit.run"
STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")


@dataclass(frozen=True)
class NodePlan:
    """What one container runs: exactly the compose target's per-node line."""

    index: int
    hostname: str
    command: list[str]
    environment: dict[str, str]


@dataclass
class NodeRun:
    plan: NodePlan
    container: Container | None = None
    status: int | None = None
    stopped_by_us: bool = False
    pump: threading.Thread | None = field(default=None, repr=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--grace", type=int, default=10, metavar="SECONDS",
                        help="after a failure or Ctrl-C: stop containers with this timeout, then kill (default 10)")
    parser.add_argument("--shm-size", default="1g", help="/dev/shm size per container (DataLoader workers use it)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN ARGS",
                        help="arguments appended to the job's command (after --)")


def docker_spec(args: argparse.Namespace) -> JobSpec:
    spec = spec_from_args(args)
    extra = [a for a in args.train_args if a != "--"]
    if extra:
        command = Command(**(spec.command.model_dump() | {"args": [*spec.command.args, *extra]}))
        spec = spec.model_copy(update={"command": command})
    return spec


def plan(spec: JobSpec) -> list[NodePlan]:
    argv = torchrun_argv(spec, sources(spec, Target.COMPOSE))
    base_env = job_env(spec) | {"PYTHONUNBUFFERED": "1"}
    plans = []
    for index, host in enumerate(hosts_for(spec, Target.COMPOSE)):
        injected = controller_env(spec, Target.COMPOSE, index)
        plans.append(NodePlan(index, host, [a.resolve(injected) for a in argv], base_env | injected))
    return plans


def _gpu_requests(spec: JobSpec) -> list[object]:
    import docker.types

    if spec.gpus_per_node == 0:
        return []
    return [docker.types.DeviceRequest(count=spec.gpus_per_node, capabilities=[["gpu"]])]


def _ensure_image(client: docker.DockerClient, image: str) -> str | None:
    """None when the image is here (pulled if need be), else why not."""
    import docker.errors

    try:
        client.images.get(image)
        return None
    except docker.errors.ImageNotFound:
        pass
    try:
        client.images.pull(image)
        return None
    except docker.errors.APIError as exc:
        return (f"image {image!r} is not on this Docker host and could not be pulled ({exc.explanation}); "
                "build it (`make image-cpu IMAGE=...`) or set `image:` / --image")


def _pump(run: NodeRun, console: object) -> None:
    from rich.text import Text

    assert run.container is not None
    style = STYLES[run.plan.index % len(STYLES)]
    pending = b""
    for chunk in run.container.logs(stream=True, follow=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            console.print(Text.assemble((f"[node{run.plan.index}] ", style), line), soft_wrap=True)  # type: ignore[attr-defined]
    if pending:
        console.print(Text.assemble((f"[node{run.plan.index}] ", style), pending.decode("utf-8", "replace")))  # type: ignore[attr-defined]


def _wait(run: NodeRun, events: queue.Queue[NodeRun]) -> None:
    import docker.errors

    assert run.container is not None
    try:
        run.status = int(run.container.wait()["StatusCode"])
    except docker.errors.APIError:
        run.status = -1  # removed under us: count as a failure
    events.put(run)


class DockerLaunch:
    """One run: its network, its containers, and their teardown."""

    def __init__(self, client: docker.DockerClient, spec: JobSpec, shm_size: str, grace: int) -> None:
        self.client, self.spec, self.shm_size, self.grace = client, spec, shm_size, grace
        self.run_id = uuid.uuid4().hex[:8]
        self.labels = {LABEL_JOB: spec.name, LABEL_RUN: self.run_id}
        self.network_name = f"ddpkit-{spec.name}-{self.run_id}"
        self.network = None
        self.runs: list[NodeRun] = []

    def start(self, plans: list[NodePlan], console: object) -> queue.Queue[NodeRun]:
        self.network = self.client.networks.create(self.network_name, driver="bridge", labels=self.labels)
        events: queue.Queue[NodeRun] = queue.Queue()
        for p in plans:
            run = NodeRun(p)
            self.runs.append(run)
            run.container = self._create(p)
            run.container.start()
        for run in self.runs:
            run.pump = threading.Thread(target=_pump, args=(run, console), daemon=True)
            run.pump.start()
            threading.Thread(target=_wait, args=(run, events), daemon=True).start()
        return events

    def _create(self, p: NodePlan) -> Container:
        name = f"{self.network_name}-node{p.index}"
        endpoint = self.client.api.create_endpoint_config(aliases=[p.hostname])
        config = self.client.api.create_networking_config({self.network_name: endpoint})
        host_config = self.client.api.create_host_config(shm_size=self.shm_size,
                                                         device_requests=_gpu_requests(self.spec))
        created = self.client.api.create_container(
            self.spec.image, command=p.command, environment=p.environment, hostname=p.hostname,
            name=name, labels=self.labels, networking_config=config, host_config=host_config)
        return self.client.containers.get(created["Id"])

    def supervise(self, events: queue.Queue[NodeRun]) -> NodeRun | None:
        """Wait for every container; on the first non-zero exit stop the
        rest and return that node. Polls so that Ctrl-C gets through."""
        done = 0
        while done < len(self.runs):
            try:
                run = events.get(timeout=0.5)
            except queue.Empty:
                continue
            done += 1
            if run.status != 0:
                self.stop()
                return run
        return None

    def stop(self) -> None:
        import docker.errors

        for run in self.runs:
            if run.container is None or run.status is not None:
                continue
            run.stopped_by_us = True
            try:
                run.container.stop(timeout=self.grace)
            except docker.errors.APIError:
                pass

    def remove(self) -> None:
        """Remove every container of this run and its network, whatever happened."""
        import docker.errors

        for container in self.client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={self.run_id}"}):
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass
        if self.network is not None:
            try:
                self.network.remove()
            except docker.errors.APIError:
                pass


def summary(console: object, runs: list[NodeRun], failed: NodeRun | None, interrupted: bool) -> None:
    from rich.table import Table

    table = Table(title=f"launch docker: {len(runs)} nodes", title_justify="left")
    for col in ("node", "exit code", "status"):
        table.add_column(col)
    for run in runs:
        if run is failed:
            status = "[red]failed first[/]"
        elif run.stopped_by_us:
            status = "[yellow]stopped[/]"
        else:
            status = "[green]ok[/]" if run.status == 0 else "[red]failed[/]"
        table.add_row(f"node{run.plan.index}", str(run.status), status)
    console.print(table)  # type: ignore[attr-defined]
    if interrupted:
        console.print("[yellow]launch docker: interrupted; stopped and removed all containers[/]")  # type: ignore[attr-defined]
    elif failed is not None:
        console.print(f"[bold red]launch docker: node{failed.plan.index} exited with code {failed.status}; "  # type: ignore[attr-defined]
                      "stopped the other nodes[/]")


def run(args: argparse.Namespace) -> int:
    import docker
    from rich.console import Console

    spec = docker_spec(args)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        print(f"ddpkit launch docker: cannot reach the Docker daemon ({exc}); start dockerd or set DOCKER_HOST",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    problem = _ensure_image(client, spec.image)
    if problem:
        print(f"ddpkit launch docker: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    launch = DockerLaunch(client, spec, args.shm_size, args.grace)
    console.print(f"launch docker: {spec.nodes} containers of {spec.image} x {spec.nproc_per_node} processes "
                  f"on network {launch.network_name}, master node0", markup=False)
    failed, interrupted = None, False
    try:
        with interrupts_raise():
            failed = launch.supervise(launch.start(plan(spec), console))
    except KeyboardInterrupt:
        interrupted = True
        launch.stop()
    finally:
        for r in launch.runs:
            if r.pump is not None:
                r.pump.join(timeout=5)
        launch.remove()
    summary(console, launch.runs, failed, interrupted)
    if interrupted:
        return 130
    if failed is not None:
        return failed.status or 1
    return 0
