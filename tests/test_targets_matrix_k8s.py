"""The targets matrix on each Kubernetes kind (tests/test_targets_matrix.py
says what is compared): the rendered manifest's pods emulated in Docker with
the controller's environment (tests/test_k8s_emulated.py), on the session's
daemon and CPU image. Beyond the contract: no `$(VAR)` reaches a pod
unexpanded, pod i carries node rank i, and the rank table users read is whole.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import render
from tests.helpers.matrix import IN_IMAGE, NODES, NPROC, check, write_spec
from tests.helpers.rank_records import records
from tests.helpers.tiers import full_case
from tests.infra import docker_daemon as daemon_infra
from tests.infra import rank_table
from tests.infra.docker_daemon import Docker

docker_daemon = daemon_infra.docker_daemon  # the session fixture, by its name


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
# Indexed Job, TrainJob and JobSet: the same pods as the PyTorchJob's under another controller's
# variables, which test_contract.py resolves and the rendering tests check against the controllers' rules
@pytest.mark.parametrize("kind", ["pytorchjob", full_case("indexed-job"), full_case("trainjob"), full_case("jobset")])
def test_kubernetes_emulated(docker_daemon: Docker, tmp_path: Path, kind: str) -> None:
    from tests.test_k8s_emulated import pods, run_pods

    assert docker_daemon.image is not None
    spec = load_spec(write_spec(tmp_path, image=docker_daemon.image, **IN_IMAGE, **{"k8s.kind": kind}))
    (text,) = render(spec, "k8s").files.values()
    emulated = pods(spec, text)
    assert not any("$(" in a for p in emulated for a in p.argv), "an unexpanded $(VAR) reached a pod"
    started = time.monotonic()
    codes, logs = run_pods(docker_daemon, emulated)
    assert codes == [0] * NODES, "\n".join(logs)[-6000:]
    check(f"k8s {kind}", logs[0], started)
    assert rank_table.problems(logs[0], NODES * NPROC, NPROC) == [], logs[0][-6000:]  # the table users read
    # The controller's index, not only distinct pods: pod i runs node rank i.
    node_hosts = {int(r["node_rank"]): r["host"] for r in records(logs[0])}
    assert node_hosts == {i: p.hostname for i, p in enumerate(emulated)}, "pod i must carry node rank i"
