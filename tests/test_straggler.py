"""The straggler judge's parts without a job: the rule (pure), the window,
the published record, the settings, a rank's own-work timer on a real model
(and on a real one-rank gloo DDP, whose comm hook it installs), the store
protocol on a real TCPStore, and the launcher's summary column. The real
2x2 job is tests/test_straggler_local.py."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit import records
from ddpkit.contract import RowKey, target_env
from ddpkit.launch.supervise.nodestate import NodeState, NodeTrack
from ddpkit.launch.supervise.outcome import Outcome
from ddpkit.launch.supervise.summary import summary_table
from ddpkit.launch.supervise.supervisor import Supervisor
from ddpkit.runs import NodeRow, RunSummary
from ddpkit.shared import envnames
from ddpkit.spec import JobSpec
from ddpkit.train.watchdog import straggler
from ddpkit.train.watchdog.straggler import (
    MIN_GAP_S,
    Change,
    StragglerJudge,
    Stragglers,
    Work,
    WorkWindow,
    factor_from_env,
)
from ddpkit.train.watchdog.worktime import WARM_STEPS, SlowHook, WorkTimer
from tests.helpers.straggler_models import Sleepy


def at_once(factor: float = 1.33) -> StragglerJudge:
    """The judge's comparison alone: a rank slow at one check is named (no sustain)."""
    return StragglerJudge(factor, sustain_s=0, sustain_steps=0)


def works(*own_s: float, steps: int = 10, step: int = 20) -> list[Work | None]:
    return [Work(r, step, steps, s, r // 2, f"h{r // 2}") for r, s in enumerate(own_s)]


def test_a_rank_above_factor_times_the_median_is_named_once_until_it_catches_up() -> None:
    judge = at_once()
    [change] = judge.observe(works(0.10, 0.10, 0.14, 0.10))
    assert change.slow and change.work.rank == 2 and change.median_s == 0.10 and round(change.ratio, 2) == 1.4
    assert judge.observe(works(0.10, 0.10, 0.15, 0.10)) == []  # still slow: not named again
    assert judge.observe(works(0.10, 0.10, 0.12, 0.10)) == []  # under the limit, above half the margin: still slow
    [back] = judge.observe(works(0.10, 0.10, 0.11, 0.10))
    assert not back.slow and back.work.rank == 2
    assert [c.work.rank for c in judge.observe(works(0.10, 0.10, 0.20, 0.10))] == [2]  # a second episode


def test_two_ranks_and_half_the_job_slow() -> None:
    """The lower median: with two ranks the slow one is named, and when half
    the job is slow both slow halves are; a slow majority names nobody."""
    assert [c.work.rank for c in at_once().observe(works(0.10, 0.20))] == [1]
    assert [c.work.rank for c in at_once().observe(works(0.20, 0.10, 0.20, 0.10))] == [0, 2]
    assert at_once().observe(works(0.10, 0.20, 0.20, 0.20)) == []


def test_equal_ranks_tiny_differences_and_ranks_without_enough_steps_are_not_named() -> None:
    assert at_once().observe(works(0.10, 0.11, 0.12, 0.13)) == []
    # 2x, but 5 ms a step: scheduling noise on a busy host, not a straggler
    assert at_once().observe(works(0.005, 0.005, 0.010, 0.005)) == []
    assert at_once().observe(works(0.05, 0.05, 0.05 + MIN_GAP_S + 0.02, 0.05))
    few = works(0.10, 0.10, 0.50, 0.10, steps=straggler.MIN_STEPS - 1)
    assert at_once().observe(few) == []
    assert at_once().observe([None, None, None, *works(0.1, 0.5)[:1]]) == []  # most ranks not published


def lockstep(own: Callable[[int, int], float], steps: int, ranks: int = 4) -> list[tuple[float, Change]]:
    """`ranks` ranks stepping together on a fake clock: each step lasts the
    slowest rank's own work `own(rank, step)` (the others wait for it in the
    all-reduce); every rank publishes its window and rank 0's judge checks
    once a second, as the watchdog's thread does. Each change, with its time."""
    now = [0.0]
    judge = StragglerJudge(1.33, clock=lambda: now[0])
    windows = [WorkWindow() for _ in range(ranks)]
    changes, check_at = [], 1.0
    for step in range(1, steps + 1):
        spent = [own(r, step) for r in range(ranks)]
        for window, seconds in zip(windows, spent, strict=True):
            window.add(seconds)
        now[0] += max(spent)
        while now[0] >= check_at:
            check_at += 1.0
            published = [Work(r, step, *w.median(), r // 2, f"h{r // 2}") for r, w in enumerate(windows)]
            changes += [(now[0], c) for c in judge.observe(published)]
    return changes


def test_a_spike_of_28x_on_a_busy_machine_names_nobody() -> None:
    """Rank 0 at 28x the job's 0.05 s for a few steps (the median turns only
    at 6 of 10), then for 20 steps, 28 s: the median is slow for about 20
    steps, fewer than SUSTAIN_STEPS. No verdict, and so nothing to take back."""
    for spike in (4, 8, 20):
        assert lockstep(lambda r, s, n=spike: 1.4 if r == 0 and 50 <= s < 50 + n else 0.05, 200) == [], spike
    # A spike long in steps but short in seconds (fast steps): below SUSTAIN_S.
    assert lockstep(lambda r, s: 0.2 if r == 0 and 50 <= s < 110 else 0.02, 300) == []


def test_a_rank_steadily_3x_slower_is_named_within_the_stated_time() -> None:
    """From step 30 rank 2's own work is 3x the others' (0.1 s): named once,
    no sooner than SUSTAIN_S and SUSTAIN_STEPS after its median turned, and
    within what the judge's docstring states: 6 steps, then the longer of
    SUSTAIN_STEPS steps and SUSTAIN_S, then a check."""
    slow_from, step_s = 30, 0.3
    changes = lockstep(lambda r, s: step_s if r == 2 and s >= slow_from else 0.1, 200)
    [(when, change)] = changes
    began = (slow_from - 1) * 0.1  # the job's clock when rank 2 turned slow
    took = when - began
    bound = 6 * step_s + max(straggler.SUSTAIN_STEPS * step_s, straggler.SUSTAIN_S) + 1.0 + step_s
    assert change.slow and change.work.rank == 2 and round(change.ratio, 1) == 3.0, change
    assert straggler.SUSTAIN_S <= took <= bound, (took, bound)
    assert change.work.step - slow_from >= 6 + straggler.SUSTAIN_STEPS - 1, change.work


def busy(seed: int) -> Callable[[int, int], float]:
    """A merely busy machine: every step of every rank 0.05 s times up to 3
    (another tenant's threads), seeded."""
    import random

    jitter = random.Random(seed)
    table: dict[tuple[int, int], float] = {}
    return lambda r, s: table.setdefault((r, s), 0.05 * jitter.uniform(1.0, 3.0))


def test_the_trials_hiccup_on_two_ranks_names_nobody_and_a_real_straggler_is_named_in_time() -> None:
    """The newcomer's 2 x 1 job: on a busy machine rank 0 ran 28x the median
    from step 47 for 22 steps (31 s), named at step 53 and taken back 20 steps
    later. Now nobody is named, whatever the machine's noise: the burst's last
    steps in the window and the noise no longer carry it past the rule (with
    the sustain alone, 2 of 40 seeds named rank 0 at the burst's end). The
    controls on the same busy machine: rank 1 three times slower for good from
    step 30 is named within the detection time hangs.md states (6 steps, then
    the longer of SUSTAIN_STEPS steps and SUSTAIN_S, then a check), and a rank
    that swings between 10x and 3x every 15 steps, slow all along, is named."""
    for seed in range(40):
        noise = busy(seed)
        hiccup = lambda r, s, n=noise: 28 * 0.05 if r == 0 and 47 <= s < 69 else n(r, s)  # noqa: E731
        assert lockstep(hiccup, 300, ranks=2) == [], seed
    for seed in range(5):
        noise = busy(seed)
        steady = lambda r, s, n=noise: 3 * 0.15 if r == 1 and s >= 30 else n(r, s)  # noqa: E731
        [(when, change)] = lockstep(steady, 300, ranks=2)
        assert change.slow and change.work.rank == 1, (seed, change)
        slowest = 0.45  # the job's step from step 30 on: rank 1's
        began = sum(max(noise(r, s) for r in range(2)) for s in range(1, 30))
        bound = 6 * slowest + max(straggler.SUSTAIN_STEPS * slowest, straggler.SUSTAIN_S) + 1.0 + slowest
        assert straggler.SUSTAIN_S <= when - began <= bound, (seed, when - began, bound)

        noise = busy(seed)
        swings = lambda r, s, n=noise: 0.05 * (10 if s // 15 % 2 else 3) if r == 1 and s >= 30 else n(r, s)  # noqa: E731
        named = [c.work.rank for _, c in lockstep(swings, 300, ranks=2) if c.slow]
        assert named and set(named) == {1}, seed


def test_the_window_takes_the_lower_median_of_its_last_steps() -> None:
    window = WorkWindow(10)
    assert window.median() == (0, 0.0)
    for _ in range(10):
        window.add(0.01)
    for _ in range(5):
        window.add(0.3)
    assert window.median() == (10, 0.01)  # 5 slow steps of 10: not yet
    window.add(0.3)
    assert window.median() == (10, 0.3)  # 6 of 10


def test_the_record_line_and_settings() -> None:
    work = Work(3, 41, 10, 0.3012, 1, "node-b")
    assert Work.decode(3, work.encode().encode()) == work
    [change] = at_once().observe([Work(r, 41, 10, 0.01, r // 2, f"h{r // 2}") for r in range(3)] + [work])
    line = change.line()
    assert line.startswith("ddpkit watchdog: STRAGGLER rank 3 node 1 host node-b: 0.301s of own work a step against "
                           "the job's median 0.010s (30.1x, limit 1.33x) at step 41; its own work")
    record = change.record()
    assert (record.kind, record.state, record.rank, record.node, record.host, record.step, record.own_s,
            record.median_s) == ("straggler", "slow", 3, 1, "node-b", 41, 0.3012, 0.01)
    assert record.line == f"rank 3 (node-b): {record.detail}" and record.detail in line
    framed = records.frame(record)
    assert records.unframe(framed) == records.Stamped(record)  # what the launcher reads back
    assert factor_from_env({}) == 1.33 and factor_from_env({envnames.DDPKIT_WATCHDOG_STRAGGLER_FACTOR: "0"}) == 0
    for bad in ("1", "0.5", "fast"):
        with pytest.raises(ValueError, match="give a factor above 1"):
            factor_from_env({envnames.DDPKIT_WATCHDOG_STRAGGLER_FACTOR: bad})


def test_the_spec_field_reaches_the_job_only_when_it_is_not_the_default() -> None:
    default = target_env(JobSpec.model_validate({"name": "j"}), RowKey.SSH)
    assert envnames.DDPKIT_WATCHDOG_STRAGGLER_FACTOR not in default  # rendered files unchanged
    env = target_env(JobSpec.model_validate({"name": "j", "watchdog": {"straggler_factor": 1.5}}), RowKey.SSH)
    assert env[envnames.DDPKIT_WATCHDOG_STRAGGLER_FACTOR] == "1.5"
    with pytest.raises(ValueError, match="give a factor above 1"):
        JobSpec.model_validate({"name": "j", "watchdog": {"straggler_factor": 1.0}})


def test_the_slow_hook_parses_and_applies_to_its_rank_only() -> None:
    env = {envnames.DDPKIT_TEST_SLOW_RANK: "2:0.25:30"}
    assert SlowHook.from_env(2, env) == SlowHook(0.25, 30) and SlowHook.from_env(1, env) == SlowHook()
    assert SlowHook.from_env(0, {envnames.DDPKIT_TEST_SLOW_RANK: "0:1"}) == SlowHook(1.0, 1)
    with pytest.raises(ValueError, match="RANK:SECONDS"):
        SlowHook.from_env(0, {envnames.DDPKIT_TEST_SLOW_RANK: "0"})


def _steps(timer: WorkTimer, module: nn.Module, n: int, data_s: float) -> None:
    for _ in range(n):
        with timer.data():
            time.sleep(data_s)
            x = torch.randn(8, 4)
        with timer.forward():
            loss = module(x).sum()
        with timer.backward():
            loss.backward()
        timer.step_done()


def test_the_timer_counts_data_and_forward_and_leaves_out_what_is_no_step() -> None:
    model = Sleepy(0.03)
    window = WorkWindow(10)
    timer = WorkTimer(model, model, torch.device("cpu"), rank=0, window=window, slow=SlowHook(0.02, 3))
    _steps(timer, model, WARM_STEPS, data_s=0.0)
    assert window.count == 0  # the first steps are not counted
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(8, 4))  # an evaluation between steps: no step, not counted
    _steps(timer, model, 4, data_s=0.01)
    assert window.count == 4
    count, own = window.median()
    assert 0.03 + 0.01 + 0.02 <= own < 0.06 + 0.5, own  # forward + data + the hook (from step 3); generous above


def test_the_timer_installs_a_comm_hook_under_ddp_and_the_gradients_stay_averaged() -> None:
    """A real one-rank gloo group: DDP with the timer's hook trains to the
    same gradients as the model without DDP, and backward ends at the hook."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        plain = nn.Linear(4, 2)
        model = nn.Linear(4, 2)
        model.load_state_dict(plain.state_dict())
        ddp = nn.parallel.DistributedDataParallel(model)
        window = WorkWindow(10)
        timer = WorkTimer(ddp, model, torch.device("cpu"), rank=0, window=window, slow=SlowHook())
        x = torch.randn(8, 4)
        plain(x).sum().backward()
        with timer.forward():
            loss = ddp(x).sum()
        with timer.backward():
            loss.backward()
        assert timer._bucket is not None  # the hook ran: the backward's end is the last bucket's hand-over
        assert torch.allclose(model.weight.grad, plain.weight.grad)
    finally:
        dist.destroy_process_group()


def test_the_store_protocol_publish_judge_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Four ranks' Stragglers on a real TCPStore: nothing is judged until every
    rank published; then rank 0 names rank 3 once, with its line and record."""
    from ddpkit.train.watchdog.control_store import open_store

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    metrics = tmp_path / "m.jsonl"
    ranks = [Stragglers(open_store("127.0.0.1", server.port), r, 4, r // 2, f"h{r // 2}", metrics, factor=1.33)
             for r in range(4)]
    saved = straggler.WORK
    try:
        for r, own in [(0, 0.1), (1, 0.1), (2, 0.1)]:
            straggler.WORK = WorkWindow(10)
            for _ in range(10):
                straggler.WORK.add(own)
            ranks[r].publish()
        ranks[0].check()
        assert not metrics.exists()  # rank 3 has not published: nothing judged yet
        straggler.WORK = WorkWindow(10)
        for _ in range(10):
            straggler.WORK.add(0.3)
        ranks[3].publish()
        assert ranks[0].judge is not None
        ranks[0].judge = at_once()  # the sustain's rule: test_a_spike_... below
        ranks[0].check()
        ranks[0].check()
        ranks[1].check()  # not rank 0: no judge
    finally:
        straggler.WORK = saved
    [stamped] = records.read_file(metrics)
    record = stamped.record
    assert isinstance(record, records.Straggler)
    assert (record.rank, record.host, record.state, record.own_s, record.median_s) == (3, "h1", "slow", 0.3, 0.1)
    err = capsys.readouterr().err
    assert err.count("ddpkit watchdog: STRAGGLER rank 3 node 1 host h1: 0.300s") == 1
    assert err.count(records.frame(record)) == 1  # the record for the launcher, beside the line


class _Node:
    def __init__(self, index: int) -> None:
        self.index, self.host, self.label = index, f"h{index}", f"node{index}"

    def exit_code(self) -> int | None:
        return 0


def test_the_supervisor_marks_the_straggler_in_a_column_of_its_own() -> None:
    from rich.console import Console

    console = Console(file=open("/dev/null", "w"), width=250)  # noqa: SIM115  (closed with the test process)
    nodes = [_Node(0), _Node(1)]
    sup = Supervisor(nodes, console, 1.0)  # type: ignore[arg-type]  # _Node has what these calls read
    line = Work(3, 41, 10, 0.3, 1, "h1")
    [change] = at_once().observe([Work(r, 41, 10, 0.01, r // 2, f"h{r // 2}") for r in range(3)] + [line])
    sup.printer.line(nodes[0], "[rank0]:" + change.line())  # the line for people: no mark by itself
    assert sup.findings.straggler_ranks() == []
    sup.printer.line(nodes[0], "[rank0]:" + records.frame(change.record()))
    sup.printer.line(nodes[0], "[rank0]:" + records.frame(change.record()))  # named twice (two episodes): one mark
    outcome = Outcome(nodes=[NodeTrack(n, NodeState.FINISHED) for n in nodes],  # type: ignore[arg-type]
                      stragglers=sup.findings.straggler_ranks())
    rows = [sup._row(n, outcome) for n in nodes]  # type: ignore[arg-type]
    assert [r.straggler for r in rows] == ["", f"rank 3 (h1): {change.record().detail}"]
    record = Console(width=250, record=True)
    record.print(summary_table(RunSummary(title="t", elapsed_s=1.0, rows=rows, closing="")))
    text = record.export_text()
    assert "┃ straggler" in text and "rank 3 (h1): 0.300s of own work" in text
    plain = Console(width=250, record=True)
    plain.print(summary_table(RunSummary(title="t", elapsed_s=1.0, rows=[NodeRow(node=0, exit_code="0", status="ok",
                                                                                  host="h0")], closing="")))
    assert "straggler" not in plain.export_text()  # no straggler: no column
