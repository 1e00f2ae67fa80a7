"""`ddpkit launch docker`: N containers of the job's image act as N nodes.

Same rank contract as docker compose (contract.torchrun_argv with
RowKey.COMPOSE sources): container i is reachable as `node<i>` on a
user-defined network made for this run, gets DDPKIT_NODE_RANK=i, and node0
hosts the rendezvous. Output is streamed live with a `[nodeI]` prefix (see supervisor). Fail
fast: the first container that exits non-zero stops the others; every
container and the network are removed at the end, after Ctrl-C too, so a
node's whole output (torchrun's traceback, which the console leaves out,
included) is kept in DIR/node<I>.log: --log-dir, by default the run folder's
logs/ (`ddpkit runs`).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..contract import RowKey, job_env, one_host_gpus, resolve
from ..runs import LineBuffer, NodeLog, RunTarget
from ..shared import envnames
from ..shared.agreed import METRICS_TO_LAUNCHER
from ..shared.exitcodes import ExitCode
from ..shared.wording import plural
from ..spec import JobSpec
from ..spec.yamlfile import add_spec_arguments, spec_from_args
from ..targets import mounts
from ..targets.limits import Limits, limits
from .prelude import make_console, prelude
from .runargs import add_train_args, metrics_from_output, with_train_args
from .secrets import with_run_key
from .supervise.interrupt import interrupts_raise
from .supervise.nodeoutput import NO_EXIT_STATUS, LinePrinter, add_dedup_argument, node_log
from .supervise.summary import RunText
from .supervise.supervisor import Supervisor

if TYPE_CHECKING:
    from docker.client import DockerClient
    from docker.models.containers import Container

LABEL_JOB = "io.ddpkit.job"
LABEL_RUN = "io.ddpkit.run"


@dataclass(frozen=True)
class NodePlan:
    """What one container runs: exactly the compose target's per-node line."""

    index: int
    hostname: str
    command: list[str]
    environment: dict[str, str]


@dataclass
class ContainerNode:
    """One container acting as one node (a NodeHandle, see supervisor)."""

    plan: NodePlan
    container: Container | None = None
    status: int | None = None
    pump: threading.Thread | None = field(default=None, repr=False)
    log: Path | None = None  # the container's whole output, kept after it is removed

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def host(self) -> str:
        return self.plan.hostname

    @property
    def label(self) -> str:
        return f"node{self.plan.index}"

    def start(self, printer: LinePrinter, exited: Callable[[], None]) -> None:
        assert self.container is not None  # created by DockerLaunch, with its network
        self.container.start()
        self.pump = threading.Thread(target=self._pump, args=(printer,), daemon=True)
        self.pump.start()
        threading.Thread(target=self._wait, args=(exited,), daemon=True).start()

    def _pump(self, printer: LinePrinter) -> None:
        assert self.container is not None
        lines = LineBuffer()
        with node_log(self.log) as keep:
            for chunk in self.container.logs(stream=True, follow=True):
                keep(chunk)
                for line in lines.feed(chunk):
                    printer.line(self, line.rstrip("\r"))
        for line in lines.flush():
            printer.line(self, line)

    def _wait(self, exited: Callable[[], None]) -> None:
        import docker.errors

        assert self.container is not None and self.pump is not None
        try:
            self.status = int(self.container.wait()["StatusCode"])
        except docker.errors.APIError:
            self.status = NO_EXIT_STATUS  # removed under us: count as a failure
        self.pump.join(timeout=2)  # its last lines first
        exited()

    def exit_code(self) -> int | None:
        return self.status

    def no_status_reason(self) -> str:
        return "the container was removed while it ran"

    def stop(self, grace_s: float) -> str | None:
        import docker.errors

        if self.container is None or self.status is not None:
            return None
        try:
            self.container.stop(timeout=int(grace_s))
        except docker.errors.APIError:
            pass  # gone already: remove() cleans up
        if self.pump is not None:
            self.pump.join(timeout=5)
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--grace", type=int, default=10, metavar="SECONDS",
                        help="after a node failed: stop the other containers with this timeout, then kill "
                             "(default 10); after Ctrl-C or SIGTERM they get the grace chain's time to checkpoint "
                             "(preemption.checkpoint_s)")
    parser.add_argument("--shm-size", help="deprecated: resources.shm_size (/dev/shm per container, 8Gi by default)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="keep each node's whole output in DIR/node<I>.log (the containers are removed at the "
                             "end; default: the run folder's logs/, see `ddpkit runs`)")
    add_dedup_argument(parser)
    add_train_args(parser)


def docker_spec(args: argparse.Namespace) -> JobSpec:
    return with_train_args(spec_from_args(args), args.train_args)


def plan(spec: JobSpec, secrets: dict[str, str] | None = None, metrics: bool = False) -> list[NodePlan]:
    """secrets: their values (launch.secrets) and the run key, handed to the
    Docker API with the rest of each container's environment; no file holds them.
    metrics: a program of the user's own frames its metrics records for the launcher."""
    launch = resolve(spec, RowKey.COMPOSE)  # compose's nodes and launch line, one container each
    # job_env, not compose's: compose.cpus_per_node (its OpenMP count) is a limit launch docker does not set
    base_env = job_env(spec) | {envnames.PYTHONUNBUFFERED: "1"} | (secrets or {})
    if metrics:
        base_env[envnames.DDPKIT_METRICS] = METRICS_TO_LAUNCHER
    plans = []
    for index, host in enumerate(launch.hosts):
        injected = launch.node_vars[index]
        plans.append(NodePlan(index, host, [a.resolve(injected) for a in launch.argv], base_env | injected))
    return plans


def _gpu_requests(spec: JobSpec, node: int) -> list[object]:
    """Node `node`'s own GPUs (device ids, as compose reserves them): with a
    count alone every container would get the host's first GPUs."""
    import docker.types

    if spec.gpus_per_node == 0:
        return []
    ids = [str(i) for i in one_host_gpus(spec, node)]
    return [docker.types.DeviceRequest(device_ids=ids, capabilities=[["gpu"]])]


def _ensure_image(client: DockerClient, image: str) -> str | None:
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


class DockerLaunch:
    """One run: its network, its containers, and their teardown."""

    def __init__(self, client: DockerClient, spec: JobSpec, lim: Limits, log_dir: Path | None = None,
                 run_id: str | None = None) -> None:
        self.client, self.spec, self.limits, self.log_dir = client, spec, lim, log_dir
        # The run folder's id when there is one: `docker ps --filter label=io.ddpkit.run=<id>`
        # and the network ddpkit-<name>-<id> name the same run as `ddpkit runs`.
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.labels = {LABEL_JOB: spec.name, LABEL_RUN: self.run_id}
        self.network_name = f"ddpkit-{spec.name}-{self.run_id}"
        self.network = None
        self.runs: list[ContainerNode] = []

    def create(self, plans: list[NodePlan]) -> list[ContainerNode]:
        """The network and one created (not started) container per node."""
        self.network = self.client.networks.create(self.network_name, driver="bridge", labels=self.labels)
        for p in plans:
            log = None if self.log_dir is None else self.log_dir / f"node{p.index}.log"
            self.runs.append(ContainerNode(p, self._create(p), log=log))
        return self.runs

    def _create(self, p: NodePlan) -> Container:
        name = f"{self.network_name}-node{p.index}"
        endpoint = self.client.api.create_endpoint_config(aliases=[p.hostname])
        config = self.client.api.create_networking_config({self.network_name: endpoint})
        # init: docker's tini is PID 1 and passes the stop signal on. torchrun
        # as PID 1 ignores SIGTERM until it has installed its handler, so a
        # Ctrl-C during start-up waited out the whole grace before SIGKILL.
        host_config = self.client.api.create_host_config(shm_size=self.limits.shm_size, init=True,
                                                         nano_cpus=self.limits.nano_cpus, mem_limit=self.limits.memory,
                                                         binds=mounts.binds(self.spec),
                                                         device_requests=_gpu_requests(self.spec, p.index))
        created = self.client.api.create_container(
            self.spec.image, command=p.command, environment=p.environment, hostname=p.hostname,
            name=name, labels=self.labels, networking_config=config, host_config=host_config)
        return self.client.containers.get(created["Id"])

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


def daemon_unreachable(env: Mapping[str, str]) -> str:
    """The one line for a Docker daemon that does not answer (docker/daemon-check.sh says the same)."""
    host = env.get("DOCKER_HOST")
    tried = f"DOCKER_HOST={host}" if host else "unix:///var/run/docker.sock (DOCKER_HOST is not set)"
    return (f"cannot reach the Docker daemon at {tried}; start it (sudo systemctl start docker, or sudo dockerd &) "
            "or set DOCKER_HOST to a running daemon; nothing was started")


def _limits(spec: JobSpec, shm_size: str | None) -> Limits:
    """The spec's limits; the old --shm-size flag still wins, with a note."""
    lim = limits(spec)
    if shm_size is None:
        return lim
    print("launch docker: note: --shm-size is deprecated; write resources.shm_size in the spec "
          "(or --set resources.shm_size=8Gi)", file=sys.stderr)
    return Limits(shm_size, lim.cpus, lim.memory)


def run(args: argparse.Namespace) -> int:
    import docker.client
    import docker.errors

    ready = prelude(docker_spec(args), "launch docker", RowKey.COMPOSE)  # the containers run compose's launch line
    spec, secrets = ready.spec, with_run_key(ready.secrets)
    console = make_console()
    try:
        client = docker.client.DockerClient.from_env()
        client.ping()
    except docker.errors.DockerException:
        print(f"ddpkit launch docker: {daemon_unreachable(os.environ)}", file=sys.stderr)
        return ExitCode.PREFLIGHT
    problem = _ensure_image(client, spec.image)
    if problem:
        print(f"ddpkit launch docker: {problem}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    for warning in mounts.container_warnings(spec, "launch docker"):
        print(warning, file=sys.stderr)
    run = ready.run_folder(RunTarget.DOCKER)
    launch = DockerLaunch(client, spec, _limits(spec, args.shm_size), args.log_dir or run.logs_dir,
                          run_id=run.record().id)
    console.print(f"launch docker: {plural(spec.nodes, 'container')} of {spec.image} x {plural(spec.nproc_per_node, 'process')} "
                  f"on network {launch.network_name}, master node0", markup=False)
    if ready.note_line:
        console.print(ready.note_line, markup=False)
    console.print(ready.run_line(run), markup=False)
    metrics = metrics_from_output(spec, run.metrics_file)
    supervisor = Supervisor([], console, args.grace, interrupt_grace_s=spec.grace.launcher_grace_s,
                            ranks=spec.nodes * spec.nproc_per_node, dedup=args.dedup, run=run, metrics=metrics)
    try:
        with interrupts_raise():  # Ctrl-C while the containers are created: remove them too
            supervisor.set_nodes(list(launch.create(plan(spec, secrets, metrics is not None))))
            run.set_logs([NodeLog(node=n.index, host=n.host, path=str(n.log)) for n in launch.runs if n.log])
        outcome = supervisor.run()
    except KeyboardInterrupt:
        outcome = supervisor.outcome(interrupted=True)
    finally:
        launch.remove()
    supervisor.summary(outcome, RunText("launch docker", "interrupted; stopped and removed all containers"))
    return outcome.code
