"""Pre-emption across ranks: the pipelined stop agreement.

Real processes, gloo on the CPU: the agreement on its own in two spawned
ranks (over the default group, and over a group of its own as with NCCL),
and `ddpkit train` started by hand as two ranks where a signal reaches only
one of them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit.train.startup.distributed import DistContext, add_startup_arguments, run_spawned
from ddpkit.train.stop.signals import StopAgreement, StopRequest, cpu_group
from tests.helpers.runs import ROOT, TINY, Job, alone, assert_bitwise_equal, final_model, metrics, run_ok, wait_for_step
from tests.helpers.tiers import FULL, one_case_in_ci

pytestmark = pytest.mark.slow

CHECKS = 12


# ---- the agreement alone, two spawned ranks ------------------------------------------
def _agree(ctx: DistContext, out: str, group_backend: str, signal_rank: int, signal_at: int) -> None:
    """One rank: CHECKS steps, each with a default-group all-reduce (standing in
    for DDP's gradients) and a barrier every third step (a checkpoint), then
    the check. `signal_rank` sends itself SIGUSR2 just before check `signal_at`."""
    stop = StopRequest()
    stop.install()
    agreement = StopAgreement(stop, True, cpu_group(group_backend))
    stopped_at = None
    for step in range(CHECKS):
        grad = torch.full((4,), float(ctx.rank))
        dist.all_reduce(grad)
        if step % 3 == 2:
            dist.barrier()
        if ctx.rank == signal_rank and step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR2)
        if agreement.check():
            stopped_at = step
            break
    agreement.finish()  # with nothing signalled, the last all-reduce is still in flight here
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(
        {"stopped_at": stopped_at, "requested": stop.requested, "grad": grad.tolist()}))


def _spawn_two(tmp: Path, **kwargs: Any) -> dict[int, dict]:
    parser = argparse.ArgumentParser()
    add_startup_arguments(parser)
    args = parser.parse_args(["--spawn", "2", "--device", "cpu", "--backend", "gloo", "--interface", "lo"])
    run_spawned(args, functools.partial(_agree, out=str(tmp), **kwargs))
    return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)}


# CI: rank 1 signalled on the default group, rank 0 on a group of its own; the full matrix
# adds the other two pairs.
@pytest.mark.parametrize(("group_backend", "signal_rank"), [
    pytest.param("gloo", 1, id="1-default-group"), pytest.param("nccl", 0, id="0-own-gloo-group"),
    pytest.param("gloo", 0, id="0-default-group", marks=FULL), pytest.param("nccl", 1, id="1-own-gloo-group", marks=FULL)])
def test_one_rank_signalled_both_stop_one_step_later(tmp_path: Path, group_backend: str, signal_rank: int) -> None:
    # "nccl" takes the path a NCCL job takes: the flag goes over a gloo group
    # of its own, created beside the default (here gloo) group.
    got = _spawn_two(tmp_path, group_backend=group_backend, signal_rank=signal_rank, signal_at=4)
    assert got[signal_rank]["requested"] and not got[1 - signal_rank]["requested"]
    # the flag set before check 4 is read at check 5, on both ranks
    assert got[0]["stopped_at"] == got[1]["stopped_at"] == 5
    assert got[0]["grad"] == got[1]["grad"] == [1.0] * 4


def test_no_signal_runs_to_the_end_and_drains(tmp_path: Path) -> None:
    got = _spawn_two(tmp_path, group_backend="nccl", signal_rank=-1, signal_at=-1)
    assert got[0]["stopped_at"] is got[1]["stopped_at"] is None


def test_single_process_reads_its_own_flag_at_once() -> None:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        stop = StopRequest()
        stop.install()
        agreement = StopAgreement(stop, distributed=False)
        assert not agreement.check()
        os.kill(os.getpid(), signal.SIGTERM)
        assert agreement.check()  # no peers to wait for: the very next check
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# ---- ddpkit train, two ranks started by hand -----------------------------------------
STEPS = 1000  # one epoch of 4000 samples / 2 ranks / batch 2: never over before the signal lands


def manual_job(tmp: Path, tag: str, extra: Sequence[str] = ()) -> Job:
    """Two `ddpkit train` processes joined through a file store; each a child
    of this test, so that it can be signalled alone and its exit code read."""
    common = [*TINY, "--synthetic-size", str(STEPS * 4), "--batch-size", "2", "--no-eval", "--log-every", "1",
              "--checkpoint-dir", str(tmp / "ckpt"), "--metrics", str(tmp / f"{tag}.jsonl"),
              "--log-dir", str(tmp / f"logs-{tag}"), "--init-method", f"file://{tmp}/rdv-{tag}",
              "--world-size", "2", "--device", "cpu", *extra]
    ranks = [alone(tmp, [*common, "--rank", str(r)], tag=f"{tag}-rank{r}") for r in (0, 1)]
    return Job([j.procs[0] for j in ranks], [j.logs[0] for j in ranks])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("reference")
    run_ok(manual_job(tmp, "ref"))
    return final_model(tmp / "ckpt")


@pytest.mark.full  # the agreed step: the tests above; a stop resumed bitwise: test_preempt_slurm.py
@pytest.mark.parametrize("sig, rank", one_case_in_ci([(signal.SIGTERM, 1), (signal.SIGUSR2, 0)], keep=(signal.SIGTERM, 1)),
                         ids=["SIGTERM-rank1", "SIGUSR2-rank0"])
def test_signal_to_one_rank_stops_both_at_one_step_then_resumes_exactly(
        tmp_path: Path, reference: dict, sig: int, rank: int) -> None:
    job = manual_job(tmp_path, "run")
    wait_for_step(tmp_path / "run.jsonl", 20, job)
    job.procs[rank].send_signal(sig)
    assert job.wait(120) == [75, 75], job.output()[-4000:]

    summary = [r for r in metrics(tmp_path / "run.jsonl") if r["kind"] == "summary"][-1]
    stopped = summary["steps"]
    assert summary["status"] == "preempted" and 20 < stopped < STEPS
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"ckpt-{stopped:08d}.pt"
    for r in (0, 1):  # the other rank never got the signal, yet stopped after the same step
        log = (tmp_path / "logs-run" / f"rank{r}.log").read_text()
        assert f"stop signal received: checkpointing at step {stopped} " in log, log[-2000:]

    run_ok(manual_job(tmp_path, "resumed", ["--resume", "auto"]))
    assert f"at step {stopped} " in (tmp_path / "logs-resumed" / "rank1.log").read_text()
    assert_bitwise_equal(reference, final_model(tmp_path / "ckpt"))


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_stopflag_bench_writes_every_variant_and_ratio(tmp_path: Path) -> None:
    """bench/stopflag.py end to end with a few steps; figures present and positive, none compared."""
    done = subprocess.run([sys.executable, "-m", "bench.stopflag", "--steps", "20", "--warmup", "2",
                           "--out", str(tmp_path), "--name", "f"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((tmp_path / "f.json").read_text())
    assert set(data["variants"]) == {"blocking", "pipelined", "own group"}
    for name, row in data["variants"].items():
        assert row["in_check_us"] > 0 and row["step_us"] > 0, name
    assert all(v > 0 for v in data["ratios"].values()) and data["baseline_step_us"] > 0
