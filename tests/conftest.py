"""Suite-wide hooks: tests marked `gpu` need a CUDA device and are skipped,
with a one-line reason, on a machine without one; no test leaks environment
variables into the ones after it; the header says how fast this machine is
(tests/timings.py's calibration) and every run ends with the time each test
module took (setup, call and teardown added up, across xdist workers), next
to pytest's --durations table, and the run's wall and CPU time, also in
units of that calibration, so that CI logs of different machines compare."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator

import pytest

from tests import timings
from tests.helpers import matrix
from tests.infra import docker_daemon
from tests.infra.shared import restore_after_each_test, slurm_pool, ssh_pool  # noqa: F401  (fixtures)

GPU_SKIP_REASON = "needs a CUDA GPU (none here)"


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


# Every launch and submit records a run folder (ddpkit.runs): the suite's go
# to a folder of its own, never the user's ~/.ddpkit/runs. Tests that list
# runs set DDPKIT_RUNS_DIR to their own tmp_path on top of this.
RUNS_DIR = "DDPKIT_RUNS_DIR"
_OWN_RUNS_DIR = "DDPKIT_TEST_RUNS_DIR_OWNER"


def pytest_configure(config: pytest.Config) -> None:
    """The main process names this run before xdist starts its workers (they
    inherit the variable): the run whose Docker daemon and image they share,
    and the folder every run folder goes to."""
    if not _is_xdist_worker(config):
        os.environ[docker_daemon.RUN_VAR] = uuid.uuid4().hex
        os.environ[RUNS_DIR] = tempfile.mkdtemp(prefix="ddpkit-test-runs-")
        os.environ[_OWN_RUNS_DIR] = str(os.getpid())


_RUN_TIME_START = pytest.StashKey[tuple[float, float, float]]()  # calibration s, wall clock, machine busy s
_WORKERS_CPU_S: list[float] = []


def pytest_report_header(config: pytest.Config) -> str:
    """Before the first test (the controller's header): how fast this machine
    is now. Also where the run's wall clock and the machine's CPU count start."""
    seconds = timings.calibrate()
    config.stash[_RUN_TIME_START] = (seconds, time.perf_counter(), timings.machine_busy_seconds())
    return (f"machine speed: a 10-million-addition Python loop took {seconds:.2f} s "
            f"({timings.CALIBRATION_REFERENCE}); {os.cpu_count()} cores")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """An xdist worker's CPU time, sent back by its pytest_sessionfinish."""
    output = getattr(node, "workeroutput", {})
    if "cpu_s" in output:
        _WORKERS_CPU_S.append(float(output["cpu_s"]))


def _run_time(config: pytest.Config) -> timings.RunTime | None:
    if _RUN_TIME_START not in config.stash:
        return None
    calibration_s, started, busy = config.stash[_RUN_TIME_START]
    if _WORKERS_CPU_S:  # the workers counted their children; the controller's children are the workers
        suite_cpu = timings.own_cpu_seconds(children=False) + sum(_WORKERS_CPU_S)
    else:
        suite_cpu = timings.own_cpu_seconds()
    return timings.RunTime(calibration_s, time.perf_counter() - started, suite_cpu,
                           timings.machine_busy_seconds() - busy)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _is_xdist_worker(config) and os.environ.get(_OWN_RUNS_DIR) == str(os.getpid()):
        shutil.rmtree(os.environ.pop(RUNS_DIR), ignore_errors=True)
        os.environ.pop(_OWN_RUNS_DIR)
    if not _is_xdist_worker(config) and docker_daemon.RUN_VAR in os.environ:
        matrix.remove_folder()
        docker_daemon.stop_if_started_by(os.environ.pop(docker_daemon.RUN_VAR))


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# A test the timings table does not know yet (a new one): what it is
# guessed to take, so that a new module of real-process tests starts early.
NEW_SLOW_TEST_S, NEW_TEST_S = 60.0, 0.5


def _expected_cost(items: list[pytest.Item], known: dict[str, float]) -> float:
    """What a module is expected to take in this run: the tests selected,
    each at its time in tests/test_seconds.json (a `make test-full` run on
    the 2-core machine) or, if new, at a guess by its markers. Costing the
    selected tests, not the module, keeps a module whose long tests are
    deselected (`make test` leaves out the `full` ones) from starting first."""
    cost = 0.0
    for item in items:
        if item.nodeid in known:
            cost += known[item.nodeid]
        elif item.get_closest_marker("root") or item.get_closest_marker("slow"):
            cost += NEW_SLOW_TEST_S
        else:
            cost += NEW_TEST_S
    return cost


@pytest.hookimpl(trylast=True)  # after `-m`'s deselection: only what runs is costed
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules longest first, so that `--dist loadfile` (a module runs on one
    xdist worker, in order: its module-scoped clusters are built once) starts the long
    modules at once and ends on short ones, instead of starting a 5-minute
    module when the others are done; the modules that need the Docker image
    come after a few minutes' worth of others, while it is set up in the
    background (tests/infra/docker_daemon.py). Then `gpu` tests are skipped
    where there is no GPU."""
    known = timings.load_test_seconds()
    by_module: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_module[_module(item.nodeid)].append(item)
    ordered = sorted(by_module.values(), key=lambda module_items: -_expected_cost(module_items, known))
    if any(_needs_docker(module_items) for module_items in ordered) and not config.option.collectonly:
        docker_daemon.set_up_in_background(os.environ[docker_daemon.RUN_VAR])
        ordered = _docker_modules_later(ordered, known, _workers(config))
    items[:] = [item for module_items in ordered for item in module_items]
    _skip_gpu_tests_without_a_gpu(items)


def _needs_docker(module_items: list[pytest.Item]) -> bool:
    return any("docker_daemon" in getattr(item, "fixturenames", ()) for item in module_items)


def _workers(config: pytest.Config) -> int:
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput["workercount"]) if workerinput else 1


def _docker_modules_later(ordered: list[list[pytest.Item]], known: dict[str, float],
                          workers: int) -> list[list[pytest.Item]]:
    """The modules that need the Docker image handed out once the others
    ahead of them are expected to keep every worker busy for the image's
    cold set-up (docker_daemon.COLD_SET_UP_S), which runs meanwhile in the
    background; each list stays longest first."""
    docker = [module_items for module_items in ordered if _needs_docker(module_items)]
    result: list[list[pytest.Item]] = []
    ahead = 0.0
    for module_items in ordered:
        if _needs_docker(module_items):
            continue
        if docker and ahead / workers >= docker_daemon.COLD_SET_UP_S:
            result += docker
            docker = []
        result.append(module_items)
        ahead += _expected_cost(module_items, known)
    return result + docker


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


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """The Docker daemon and image are set up before pytest-timeout's clock
    starts for the first test that needs them (tryfirst: this wrapper is
    outside its): a cold image build on a loaded machine is not that test's
    time. The set-up has limits of its own (tests/infra/docker_daemon.py)."""
    docker_daemon.prepare(item)
    yield


_MODULE_SECONDS: defaultdict[str, float] = defaultdict(float)
_MODULE_TESTS: defaultdict[str, set[str]] = defaultdict(set)
# The targets matrix's tests: nodeid -> (outcome, marked root), for the run's closing check.
_MATRIX_OUTCOMES: dict[str, tuple[str, bool]] = {}
_MATRIX_MISSING = pytest.StashKey[list[str]]()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Called in the controller for every phase of every test, its own or an
    xdist worker's, so the totals cover the whole run."""
    module = _module(report.nodeid)
    _MODULE_SECONDS[module] += report.duration
    _MODULE_TESTS[module].add(report.nodeid)
    if report.nodeid in matrix.TARGET_TESTS.values():
        _note_matrix_outcome(report)


def _note_matrix_outcome(report: pytest.TestReport) -> None:
    """A phase that failed or skipped decides; a passing call counts only if
    nothing before it did."""
    earlier = _MATRIX_OUTCOMES.get(report.nodeid, ("", False))[0]
    if earlier in ("failed", "skipped"):
        return
    if report.failed or report.skipped or report.when == "call":
        _MATRIX_OUTCOMES[report.nodeid] = (report.outcome, "root" in report.keywords)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The targets matrix runs in three modules on any workers; it passes as
    a whole only if every target did (what its closing test asserted when it
    was one module). Controller only: it has every worker's reports. A
    worker hands back its CPU time instead (pytest_testnodedown)."""
    if _is_xdist_worker(session.config):
        session.config.workeroutput["cpu_s"] = timings.own_cpu_seconds()  # type: ignore[attr-defined]
        return
    missing = matrix.missing_targets(_MATRIX_OUTCOMES)
    if missing and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[_MATRIX_MISSING] = missing


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    _matrix_summary(terminalreporter)
    if not _MODULE_SECONDS:
        return
    terminalreporter.section("time per test module (setup + call + teardown)")
    docker_setup = docker_daemon.setup_seconds(os.environ.get(docker_daemon.RUN_VAR, ""))
    total = sum(_MODULE_SECONDS.values()) + (docker_setup or 0.0)
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        share = 100 * seconds / total if total else 0.0
        terminalreporter.write_line(f"{seconds:8.1f}s {share:5.1f}%  {len(_MODULE_TESTS[module]):4d} tests  {module}")
    if docker_setup is not None:
        share = 100 * docker_setup / total if total else 0.0
        terminalreporter.write_line(f"{docker_setup:8.1f}s {share:5.1f}%             Docker daemon and CPU image set-up "
                                    "(before the first test that needed them, outside its time)")
    terminalreporter.write_line(f"{total:8.1f}s in all (test time summed over workers; wall time is in the closing line)")
    run_time = _run_time(terminalreporter.config)
    if run_time is not None:
        terminalreporter.section("this run's time, and in units of this machine's calibration")
        for line in run_time.lines():
            terminalreporter.write_line(line)


def _matrix_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The targets covered (each target's processes, launcher, node 0's host
    and seconds), also kept in .pytest_cache/targets-matrix.txt."""
    if not _MATRIX_OUTCOMES or docker_daemon.RUN_VAR not in os.environ:
        return
    summary = matrix.coverage_table()
    (docker_daemon.REPO / ".pytest_cache").mkdir(exist_ok=True)
    (docker_daemon.REPO / ".pytest_cache" / "targets-matrix.txt").write_text(summary + "\n")
    terminalreporter.section("targets matrix: one spec on every target")
    for line in summary.splitlines():
        terminalreporter.write_line(line)
    missing = terminalreporter.config.stash.get(_MATRIX_MISSING, [])
    if missing:
        terminalreporter.write_line(f"FAILED: only part of the matrix passed; not: {', '.join(missing)}", red=True)
