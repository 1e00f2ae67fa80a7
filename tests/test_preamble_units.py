"""The preamble's step counting and liveness in one process: what counts as
a training step for the hang watchdog in the loops people write (several
optimizers, gradient accumulation, a step GradScaler skips, a compiled
model), and what counts as a sign of life between steps."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpkit import watchdog
from ddpkit.preamble import metrics, progress


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


def test_the_batch_is_the_first_tensors_first_dimension() -> None:
    assert metrics.batch_rows((torch.zeros(8, 3),), {}) == 8
    assert metrics.batch_rows((), {"input_ids": torch.zeros(5, 16), "labels": torch.zeros(5)}) == 5
    assert metrics.batch_rows((torch.tensor(1.0), [1, 2]), {}) == 0  # a scalar and a list: no batch


def test_a_loop_inside_one_function_is_no_sign_of_life_but_calls_are() -> None:
    def spin(until: float) -> None:
        while time.monotonic() < until:
            pass

    seen: list[tuple[object, ...]] = []

    def sample(thread: threading.Thread) -> None:
        time.sleep(0.2)
        for _ in range(3):
            seen.append(progress.stack_of(sys._current_frames()[thread.ident or -1]))
            time.sleep(0.1)

    spinner = threading.Thread(target=spin, args=(time.monotonic() + 1.0,))
    spinner.start()
    sample(spinner)
    spinner.join()
    assert len(set(seen)) == 1 and seen[0][0] is spin.__code__


def test_a_sleeping_thread_gives_up_the_cpu_again_and_again() -> None:
    import os

    before = progress.voluntary_switches(os.getpid())
    for _ in range(5):
        time.sleep(0.01)
    assert progress.voluntary_switches(os.getpid()) - before >= progress.SWITCHES_ALIVE
