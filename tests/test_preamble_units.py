"""The preamble's step counting and liveness in one process: what counts as
a training step for the hang watchdog in the loops people write (several
optimizers, gradient accumulation, a step GradScaler skips, a compiled
model), and what counts as a sign of life between steps."""

from __future__ import annotations

import datetime
import importlib.util
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpkit import watchdog
from ddpkit.host import processes
from ddpkit.preamble import interface, progress, startup, stragglers
from ddpkit.train.watchdog import liveness
from ddpkit.train.watchdog.straggler import WorkWindow
from ddpkit.train.watchdog.worktime import WARM_STEPS
from tests.helpers.straggler_models import Sleepy


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[progress.StepCounter]:
    """A StepCounter hooked into every optimizer step for the test only; one
    process without MASTER_ADDR, so no watchdog thread starts."""
    monkeypatch.setattr(watchdog, "_state", {})
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    counted = progress.StepCounter()
    handle = register_optimizer_step_post_hook(counted.after_step)
    yield counted
    handle.remove()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, scale: float = 1.0) -> None:
    loss = model(torch.randn(4, 3)).sum() * scale
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_two_optimizers_make_one_step_per_iteration(counter: progress.StepCounter) -> None:
    generator, critic = nn.Linear(3, 1), nn.Linear(3, 1)
    g_opt, c_opt = torch.optim.SGD(generator.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
    for _ in range(5):
        _step(critic, c_opt)
        _step(generator, g_opt)
    assert counter.steps == 5  # the first optimizer that stepped (the critic's) counts


def test_gradient_accumulation_counts_the_optimizer_steps(counter: progress.StepCounter) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for micro in range(12):
        model(torch.randn(4, 3)).sum().backward()
        if micro % 4 == 3:
            optimizer.step()
            optimizer.zero_grad()
    assert counter.steps == 3


def test_a_step_gradscaler_skips_is_not_counted(counter: progress.StepCounter) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for scale in (1.0, float("inf"), 1.0):
        scaler.scale(model(torch.randn(4, 3)).sum() * scale).backward()
        scaler.step(optimizer)  # skipped when a gradient is not finite
        scaler.update()
        optimizer.zero_grad()
    assert counter.steps == 2


def test_a_compiled_model_steps_as_the_module_does(counter: progress.StepCounter) -> None:
    model = nn.Linear(3, 1)
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        _step(compiled, optimizer)
    assert counter.steps == 3


def test_a_loop_inside_one_function_is_no_sign_of_life_but_calls_are() -> None:
    def spin(until: float) -> None:
        while time.monotonic() < until:
            pass

    seen: list[tuple[object, ...]] = []

    def sample(thread: threading.Thread) -> None:
        time.sleep(0.2)
        for _ in range(3):
            seen.append(liveness.stack_of(sys._current_frames()[thread.ident or -1]))
            time.sleep(0.1)

    spinner = threading.Thread(target=spin, args=(time.monotonic() + 1.0,))
    spinner.start()
    sample(spinner)
    spinner.join()
    assert len(set(seen)) == 1 and seen[0][0] is spin.__code__


def test_a_sleeping_thread_gives_up_the_cpu_again_and_again() -> None:
    import os

    before = processes.voluntary_switches(os.getpid())
    for _ in range(5):
        time.sleep(0.01)
    assert processes.voluntary_switches(os.getpid()) - before >= liveness.SWITCHES_ALIVE


# ---- the stragglers part: each rank's own work in a one-rank gloo DDP ----------------------------


@pytest.fixture
def own_work(monkeypatch: pytest.MonkeyPatch) -> Iterator[stragglers.OwnWork]:
    """The stragglers part installed for one test (its wrappers and hook removed
    after it), timing into a window of its own, in a real one-rank gloo group."""
    import torch.optim.optimizer as optim_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    for name in ("forward", "register_comm_hook", "_register_builtin_comm_hook"):
        monkeypatch.setattr(DDP, name, getattr(DDP, name))
    monkeypatch.setattr(torch.autograd, "backward", torch.autograd.backward)
    handles: list = []
    real = optim_module.register_optimizer_step_post_hook
    monkeypatch.setattr(optim_module, "register_optimizer_step_post_hook", lambda hook: handles.append(real(hook)))
    work = stragglers.OwnWork(WorkWindow(10))
    monkeypatch.setattr(stragglers, "WORK", work)
    stragglers.install({"WORLD_SIZE": "2"})  # as a rank of a 2-process job, judged
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield work
    finally:
        dist.destroy_process_group()
        for handle in handles:
            handle.remove()


def _train(ddp: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        ddp(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_own_work_is_the_ddp_models_forward_and_backward_and_no_evaluation(own_work: stragglers.OwnWork) -> None:
    torch.manual_seed(0)
    model, plain = Sleepy(0.03), Sleepy(0.0)
    plain.load_state_dict(model.state_dict())
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    ddp(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(model.fc.weight.grad, plain.fc.weight.grad)  # DDP's default all-reduce, through the mark
    assert vars(ddp)[stragglers.MARK].default
    optimizer.step()
    optimizer.zero_grad()
    _train(ddp, optimizer, WARM_STEPS)
    assert own_work.window.count == 1  # the first WARM_STEPS steps are not counted
    with torch.no_grad():
        for _ in range(5):
            ddp(torch.randn(8, 4))  # an evaluation between steps: not counted
    _train(ddp, optimizer, 3)
    count, own = own_work.window.median()
    assert own_work.window.count == 4 and 0.03 <= own < 0.03 + 0.5, (own_work.window.count, own)


def test_a_comm_hook_the_program_registers_replaces_the_default_and_is_timed(own_work: stragglers.OwnWork) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = nn.parallel.DistributedDataParallel(Sleepy(0.0))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train(ddp, optimizer, 1)  # the first forward registered the default
    calls = []

    def counting(state, bucket):  # unannotated: DDP checks annotations as objects, and this module's are strings
        calls.append(state)
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook("program's state", counting)  # DDP itself would refuse a second hook
    mark = vars(ddp)[stragglers.MARK]
    assert not mark.default and mark.hook is counting
    with pytest.raises(RuntimeError, match="can only be called once"):  # as DDP refuses a program's second hook
        ddp.register_comm_hook(None, lambda state, bucket: None)
    own_work._bucket = None
    _train(ddp, optimizer, 1)
    assert calls == ["program's state"] and own_work._bucket is not None


def test_a_builtin_comm_hook_leaves_the_backward_untimed(own_work: stragglers.OwnWork) -> None:
    ddp = nn.parallel.DistributedDataParallel(Sleepy(0.0))
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train(ddp, optimizer, 1)
    assert stragglers.MARK not in vars(ddp) and own_work.clock is not None
    assert len(own_work.clock._step.spans) == 0 and own_work.clock.steps == 1  # the forward's span went with the step


def test_a_builtin_hook_after_the_first_forward_runs_as_its_python_twin(own_work: stragglers.OwnWork) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = nn.parallel.DistributedDataParallel(Sleepy(0.0))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train(ddp, optimizer, 1)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)  # DDP alone takes it here too
    assert vars(ddp)[stragglers.MARK].hook is default_hooks.fp16_compress_hook
    own_work._bucket = None
    _train(ddp, optimizer, 1)
    assert own_work._bucket is not None


def test_nothing_is_timed_where_no_judge_reads_it_and_a_bad_setting_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    for env in ({}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": "4", "DDPKIT_WATCHDOG_STALL_S": "0"},
                {"WORLD_SIZE": "4", "DDPKIT_WATCHDOG_STRAGGLER_FACTOR": "0"}):
        assert not stragglers.judged(env), env
    assert stragglers.judged({"WORLD_SIZE": "4"})
    with pytest.raises(SystemExit) as ended:
        stragglers.judged({"WORLD_SIZE": "4", "DDPKIT_WATCHDOG_STRAGGLER_FACTOR": "fast"})
    assert ended.value.code == 2
    assert capsys.readouterr().err == ("ddpkit: DDPKIT_WATCHDOG_STRAGGLER_FACTOR='fast': give a factor above 1 "
                                       "(e.g. 1.33), or 0 to turn straggler detection off\n")


def test_an_interface_this_host_lacks_is_one_line_and_exit_4(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        interface.install({"MASTER_ADDR": "127.0.0.1", "DDPKIT_INTERFACE": "ddpkit-none0"})
    assert ended.value.code == 4
    err = capsys.readouterr().err
    assert err.startswith("ddpkit: interface ddpkit-none0 not found on this host; it has ") and err.count("\n") == 1


def test_the_preamble_reports_no_step_where_ddpkit_trains_in_the_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that runs ddpkit train inside it: the trainer's watchdog reports the steps; the
    preamble's count starts no second watchdog and leaves the pulse alone (one owner of the rank's
    heartbeats, and of the verdict's last words)."""
    from ddpkit.train.watchdog import stall, stall_model

    monkeypatch.setattr(watchdog, "_state", {})
    trainers = object()
    monkeypatch.setattr(stall, "_RUNNING", [trainers])
    monkeypatch.setattr(stall_model.PULSE, "step", 7)
    monkeypatch.setattr(watchdog, "_start", lambda: pytest.fail("a second watchdog started"))
    watchdog.auto_progress(1)
    assert stall_model.PULSE.step == 7 and not watchdog.watching()
    monkeypatch.setattr(stall, "_RUNNING", [])  # without the trainer's, the preamble's count starts one
    started: list[int] = []
    monkeypatch.setattr(watchdog, "_start", lambda: started.append(1))
    watchdog.auto_progress(1)
    assert stall_model.PULSE.step == 1 and started == [1]


def test_a_watchdog_whose_store_does_not_answer_is_off_for_that_rank_and_the_program_goes_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The preamble's watchdog starts inside the program's first optimizer step: a store that
    does not answer there must not end the program."""
    from ddpkit.train.watchdog import stall

    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)

    def refused(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the store timed out")

    monkeypatch.setattr(stall, "start", refused)
    assert watchdog._start() is None
    assert capsys.readouterr().err == ("ddpkit watchdog: rank 1: off, its store did not answer "
                                       "(the store timed out)\n")


# ---- start-up: is the main thread waiting in a collective, or still starting -------------------

FAKE_TORCH = {  # files of a stand-in torch folder: where each function's frames sit decides
    "distributed/c10d.py": "def barrier(held):\n    held.acquire()\n",
    "distributed/elastic/errors.py": "def record(main, held):\n    main(held)\n",
    "nn/parallel/ddp.py": "def forward(model, held):\n    model(held)\n",
    "serialization.py": "def load(held):\n    held.acquire()\n",
}
BLOCKED_IN = {"barrier", "load", "own_model"}  # a thread that acquires a held lock sits in one of these


def _fake_torch(root: Path) -> dict[str, types.ModuleType]:
    modules = {}
    for name, text in FAKE_TORCH.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"fake_torch_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def _frame_while(run: Callable[[Any], object]) -> types.FrameType:
    """The innermost frame of a thread that runs `run` and blocks inside it (on a held lock)."""
    held = threading.Lock()
    held.acquire()
    thread = threading.Thread(target=run, args=(held,))
    thread.start()
    try:
        for _ in range(500):
            frame = sys._current_frames().get(thread.ident or -1)
            if frame is not None and frame.f_code.co_name in BLOCKED_IN:
                return frame
            time.sleep(0.01)
        raise AssertionError("the thread never blocked")
    finally:
        held.release()
        thread.join()


def test_a_rank_waits_in_a_collective_only_in_torchs_collective_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync: a barrier, even under torchrun's `record` around the program's main. Setup
    (the rank is still starting): torch.load, and the program's own model code that DDP's
    forward calls."""
    torch_dir = tmp_path / "torch"
    fake = _fake_torch(torch_dir)
    monkeypatch.setattr(startup, "torch_folder", lambda: str(torch_dir))
    barrier, load = fake["distributed/c10d.py"].barrier, fake["serialization.py"].load
    record, forward = fake["distributed/elastic/errors.py"].record, fake["nn/parallel/ddp.py"].forward

    def own_model(held: Any) -> None:
        held.acquire()

    def main(call: Callable[[Any], object]) -> Callable[[Any], object]:
        return lambda held: record(lambda held: call(held), held)  # the program's main under `record`

    assert startup.waits_in_a_collective(_frame_while(barrier))
    assert startup.waits_in_a_collective(_frame_while(main(barrier)))
    assert not startup.waits_in_a_collective(_frame_while(load))
    assert not startup.waits_in_a_collective(_frame_while(main(load)))
    assert not startup.waits_in_a_collective(_frame_while(lambda held: forward(own_model, held)))
    assert not startup.waits_in_a_collective(None)


def test_start_up_follows_the_main_thread_until_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit.train.watchdog import stall_model

    monkeypatch.setattr(stall_model, "PULSE", stall_model.Pulse())
    monkeypatch.setattr(startup, "waits_in_a_collective", lambda frame: frame == "in a barrier")
    startup.follow("in a barrier")  # type: ignore[arg-type]
    assert stall_model.PULSE.phase is stall_model.Phase.SYNC and stall_model.PULSE.beats == 1
    startup.follow("in a barrier")  # type: ignore[arg-type]
    assert stall_model.PULSE.beats == 1  # no change, no sign of life
    startup.follow(None)
    assert stall_model.PULSE.phase is stall_model.Phase.SETUP
    stall_model.progress(1)  # the first step ends start-up
    assert stall_model.PULSE.phase is stall_model.Phase.TRAIN
    startup.follow("in a barrier")  # type: ignore[arg-type]
    assert stall_model.PULSE.phase is stall_model.Phase.TRAIN


def test_ddpkit_trains_watchdog_takes_over_from_the_one_the_programs_start_up_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A program of the user's own that runs ddpkit train's Trainer: the preamble's watchdog,
    started at init_process_group's return, stops publishing once the trainer's starts, and
    the preamble neither samples the main thread nor reports steps any more."""
    from ddpkit.train.watchdog import stall
    from ddpkit.train.watchdog.stall_model import PULSE, Settings

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(server.port), "DDPKIT_WATCHDOG_STALL_S": "60"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(watchdog, "_state", {})
    monkeypatch.setattr(stall, "_RUNNING", [])
    watchdog.watch_start_up()
    programs = stall.running()
    assert programs is not None and watchdog.watching()
    trainers = stall.start(stall.Identity(1, 2, 1, 1, "here", 1), "127.0.0.1", server.port, stall.Outputs(),
                           Settings(stall_s=60.0))
    try:
        assert trainers is not None and stall.running() is trainers
        assert programs._stop.is_set() and not trainers._stop.is_set() and not watchdog.watching()
        step = PULSE.step
        watchdog.auto_progress(step + 1)
        assert PULSE.step == step  # the trainer's loop reports its steps
    finally:
        for dog in (programs, trainers):
            if dog is not None:
                dog.retire()
