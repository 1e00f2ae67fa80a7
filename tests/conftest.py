"""Suite-wide hooks: tests marked `gpu` need a CUDA device and are skipped,
with a one-line reason, on a machine without one; no test leaks environment
variables into the ones after it; and every run ends with the time each test
module took (setup, call and teardown added up, across xdist workers), next
to pytest's --durations table, so a CI log shows where the time went."""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from collections.abc import Iterator

import pytest

from tests.infra import docker_daemon

GPU_SKIP_REASON = "needs a CUDA GPU (none here)"


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """The main process names this run before xdist starts its workers (they
    inherit the variable): the run whose Docker daemon and image they share."""
    if not _is_xdist_worker(config):
        os.environ[docker_daemon.RUN_VAR] = uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _is_xdist_worker(config) and docker_daemon.RUN_VAR in os.environ:
        docker_daemon.stop_if_started_by(os.environ.pop(docker_daemon.RUN_VAR))


def _uses_module_fixture(item: pytest.Item) -> bool:
    """A test that uses a module-scoped fixture of this suite (a Slurm cluster,
    sshd hosts, a reference run): built once, shared by the module's tests."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        if defs and defs[-1].scope == "module" and getattr(defs[-1].func, "__module__", "").startswith("tests"):
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for `--dist loadgroup` (a group runs on one xdist worker, in
    order), before xdist reads them: a module with a module-scoped fixture
    of this suite is a group of its own, so that its cluster is built once
    and not once per worker (and the target matrix compares, in its last
    test, what its other tests kept). Modules that name a group themselves
    (`pytest.mark.xdist_group`) keep it. Everything else is spread test by
    test. Then `gpu` tests are skipped where there is no GPU."""
    by_module: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_module[item.nodeid.split("::", 1)[0]].append(item)
    for module, module_items in by_module.items():
        if any(item.get_closest_marker("xdist_group") for item in module_items):
            continue
        if any(_uses_module_fixture(item) for item in module_items):
            for item in module_items:
                item.add_marker(pytest.mark.xdist_group(module))
    _skip_gpu_tests_without_a_gpu(items)


def _skip_gpu_tests_without_a_gpu(items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Code under test sets variables in-process on purpose (netif pins
    NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, start-up sets MASTER_ADDR), and
    monkeypatch.delenv of an unset name records nothing to undo. A leaked
    `NCCL_SOCKET_IFNAME=lo` reached later Slurm jobs (sbatch exports the
    submitter's environment) and failed them in a full run only: restore the
    whole environment after every test."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_MODULE_SECONDS: defaultdict[str, float] = defaultdict(float)
_MODULE_TESTS: defaultdict[str, set[str]] = defaultdict(set)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Called in the controller for every phase of every test, its own or an
    xdist worker's, so the totals cover the whole run."""
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] += report.duration
    _MODULE_TESTS[module].add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _MODULE_SECONDS:
        return
    terminalreporter.section("time per test module (setup + call + teardown)")
    total = sum(_MODULE_SECONDS.values())
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        share = 100 * seconds / total if total else 0.0
        terminalreporter.write_line(f"{seconds:8.1f}s {share:5.1f}%  {len(_MODULE_TESTS[module]):4d} tests  {module}")
    terminalreporter.write_line(f"{total:8.1f}s in all (test time summed over workers; wall time is in the closing line)")
