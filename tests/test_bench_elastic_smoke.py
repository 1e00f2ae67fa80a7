"""bench/elastic.py end to end with the tiniest settings, on every target:
three elastic agents, one node lost mid-run, the survivors' first step timed
(tests/test_bench_smoke.py says what a smoke test asserts); and the torchft
anchor (bench/torchft_anchor.py) with one replica group killed. A module of
its own so that xdist runs it beside the other benchmarks' smoke tests.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from bench import torchft_anchor

from ddpkit.spec import JobSpec
from tests.helpers.elastic_gate import LAST_CALL_S
from tests.test_bench_smoke import run_bench

pytestmark = pytest.mark.slow


def test_each_variant_gets_its_rendezvous_settings(tmp_path: Path) -> None:
    """The two ddpkit columns differ only where the bench says: torchrun's own rendezvous, or
    --fast-spec merged in; an asked-for --last-call-s wins over both (the smoke runs below run one
    variant each, so the other's spec is checked here)."""
    from bench import elastic

    args = argparse.Namespace(fast_spec={"watchdog": {"loss_s": 10}}, last_call_s=None, samples=1600,
                              checkpoint_every=4, batch_size=None)
    specs = {v: elastic.job_spec(tmp_path, tmp_path / "ckpt", tmp_path / "m", args, v)
             for v in ("torchrun-defaults", "ddpkit-fast")}
    assert specs["torchrun-defaults"]["watchdog"] == {"loss_s": 15}
    assert specs["torchrun-defaults"]["elastic"]["rendezvous"] == "torchrun"
    assert "last_call_s" not in specs["torchrun-defaults"]["elastic"]  # torchrun's 30 s, from the rendezvous mode
    assert specs["ddpkit-fast"]["watchdog"] == {"loss_s": 10} and "last_call_s" not in specs["ddpkit-fast"]["elastic"]
    assert all(JobSpec.model_validate(spec).elastic is not None for spec in specs.values())
    args.last_call_s = 7
    assert elastic.job_spec(tmp_path, tmp_path / "ckpt", tmp_path / "m", args,
                            "torchrun-defaults")["elastic"]["last_call_s"] == 7


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_elastic_bench_times_recovery_per_loss_kind(tmp_path: Path) -> None:
    """bench/elastic.py on `launch local`: node 2 crashed, the pinned torchrun-defaults variant (torchrun's
    own rendezvous timeouts; ddpkit's fast path runs on ssh and Slurm below: two runs that each recover in
    seconds rather than one, the slowest variant paid once)."""
    run_bench("bench.elastic", "--losses", "crash", "--variants", "torchrun-defaults",
              "--repeats", "1", "--samples", "1600", "--checkpoint-every", "4",
              "--last-call-s", str(LAST_CALL_S), "--out", str(tmp_path))
    data = json.loads((tmp_path / "elastic.json").read_text())
    (run,) = data["runs"]
    assert (run["target"], run["variant"], run["loss"]) == ("local", "torchrun-defaults", "crash"), run
    assert run["loss_to_first_step_s"] > 0 and 0 <= run["steps_lost"] <= run["killed_at_step"], run
    assert not data["skipped"] and data["machine"]["torch"], data
    assert data["medians"]["local"]["crash"]["torchrun-defaults"]["runs"] == 1


@pytest.mark.full  # the benches' longer smokes: make test-full
def test_torchft_anchor_survives_a_killed_replica_group(tmp_path: Path) -> None:
    """bench/torchft_anchor.py: a real lighthouse, three replica groups, the last SIGKILLed; torchft
    with its comm hook mended (--patch-comm-hook), whose survivors train on without a restart. As
    shipped, every survivor's worker dies and must be restarted by its torchrun before a quorum of
    two forms again (docs/BENCHMARKS.md): in CI16 one survivor never came back within 300 s, and that
    path measures torchft's restart, not the anchor's machinery."""
    reason = torchft_anchor.unavailable()
    if reason:
        pytest.skip(reason)
    # torchft's 5 s timeouts at the suite's load starve live groups (CI26: a survivor lost, no quorum of
    # two for 300 s); a crash closes the lost group's connections, so the survivors see it at any timeout
    run_bench("bench.torchft_anchor", "--losses", "crash", "--repeats", "1", "--steps", "300",
              "--kill-after", "5", "--patch-comm-hook", "--pg-timeout-s", "30", "--heartbeat-timeout-ms", "10000",
              "--out", str(tmp_path))
    data = json.loads((tmp_path / "torchft_anchor.json").read_text())
    assert (data["pg_timeout_s"], data["lighthouse"]["heartbeat_timeout_ms"]) == (30, 10000)
    (run,) = data["runs"]
    assert run["variant"] == "torchft-patched" and run["loss"] == "crash", run
    assert run["loss_to_first_step_s"] > 0 and run["killed_at_step"] >= 5, run
    assert not run["survivor_restarted"], run  # trained through the loss, as torchft intends


@pytest.mark.full  # the benches' longer smokes: make test-full
@pytest.mark.root
def test_elastic_bench_on_launch_ssh_and_real_slurm(tmp_path: Path) -> None:
    """bench/elastic.py's real targets: namespace hosts with sshd, and slurmctld with three slurmds
    (node 2 crashed, ddpkit's fast path; launch local above runs the pinned torchrun-defaults variant)."""
    from tests.infra import netns, slurm_cluster, sshd

    reason = netns.available() or sshd.available() or slurm_cluster.available()
    if reason or os.geteuid() != 0:
        pytest.skip(reason or "needs root")
    run_bench("bench.elastic", "--targets", "ssh,slurm", "--losses", "crash", "--variants", "ddpkit-fast",
              "--repeats", "1",
              "--samples", "1600", "--checkpoint-every", "4", "--last-call-s", str(LAST_CALL_S),
              "--out", str(tmp_path))
    data = json.loads((tmp_path / "elastic.json").read_text())
    assert [(r["target"], r["loss"]) for r in data["runs"]] == [("ssh", "crash"), ("slurm", "crash")]
    for run in data["runs"]:
        assert run["loss_to_first_step_s"] > 0 and 0 <= run["steps_lost"] <= run["killed_at_step"], run
    assert set(data["medians"]) == {"ssh", "slurm"}
