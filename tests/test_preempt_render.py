"""The pre-emption grace chain, read back from what every target renders:
checkpoint_s < torchrun's --shutdown-timeout < the scheduler's warning
(Slurm --signal=B:SIG@N, Kubernetes terminationGracePeriodSeconds, compose's
stop_grace_period, the SSH launcher's interrupt grace, launch local/docker/
ssh's interrupt grace), for the default spec, a long checkpoint, older specs
that set only a scheduler warning, and an explicit override; and the one-line
errors for a chain that cannot hold."""

from __future__ import annotations

import re
import signal as signal_module
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from ddpkit.launch import local
from ddpkit.shared.agreed import TORCHRUN_DEFAULT_SIGNALS, TRAINER_STOP_SIGNALS
from ddpkit.spec import JobSpec
from ddpkit.targets import kubernetes, render, slurm
from ddpkit.train.stop import signals

KINDS = ["pytorchjob", "indexed-job", "trainjob", "jobset"]
CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "long-checkpoint": {"preemption": {"checkpoint_s": 600}},
    "short-checkpoint": {"preemption": {"checkpoint_s": 5}},
    "old-spec-k8s-30": {"k8s": {"termination_grace_s": 30}},
    "old-spec-slurm-120": {"slurm": {"signal_seconds": 120}},
    "old-spec-both": {"slurm": {"signal_seconds": 10}, "k8s": {"termination_grace_s": 300}},
    "override-above-chain": {"preemption": {"checkpoint_s": 10}, "slurm": {"signal_seconds": 200}},
    "term-signal": {"preemption": {"signal": "TERM", "checkpoint_s": 30}},
}


def make(case: str, **extra: Any) -> JobSpec:
    """The case's fields, with `extra` merged into them (section by section)."""
    fields: dict[str, Any] = {key: dict(value) for key, value in CASES[case].items()}
    for key, value in extra.items():
        fields[key] = {**fields.get(key, {}), **value} if isinstance(value, dict) else value
    return JobSpec(name="chain", nodes=2, nproc_per_node=2, **fields)


def flag(argv: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return value


def shutdown_of(words: list[str]) -> int:
    """torchrun's --shutdown-timeout in a launch line, checking that the
    agent forwards every signal the trainer stops on."""
    handled = flag(words, "signals-to-handle").split(",")
    assert set(TRAINER_STOP_SIGNALS) | set(TORCHRUN_DEFAULT_SIGNALS) <= set(handled), handled
    return int(flag(words, "shutdown-timeout"))


def words_in(text: str) -> list[str]:
    return re.findall(r"--(?:signals-to-handle|shutdown-timeout)=[A-Z0-9,]+", text)


def check_chain(spec: JobSpec, shutdown: int | None, warning: float, where: str) -> None:
    inner = spec.grace.checkpoint_s if shutdown is None else shutdown
    assert shutdown is None or shutdown > spec.grace.checkpoint_s, f"{where}: shutdown {shutdown} <= checkpoint"
    assert warning > inner, f"{where}: warning {warning} s <= {inner} s"


@pytest.mark.parametrize("case", CASES)
def test_slurm_both_modes(case: str) -> None:
    for mode in ("torchrun", "srun"):
        spec = make(case, slurm={"mode": mode})
        text = render(spec, "slurm").files["chain.sbatch"]
        (directive,) = [d for d in slurm.parse_directives(text) if d.startswith("--signal=")]
        sig, warning = re.fullmatch(r"--signal=B:(USR2|TERM)@(\d+)", directive).groups()  # type: ignore[union-attr]
        assert f"SIG{sig}" in TRAINER_STOP_SIGNALS and sig == spec.preemption.signal
        found = words_in(text)
        if mode == "torchrun":
            check_chain(spec, shutdown_of(found), int(warning), f"slurm {mode}")
            assert f"SIG{sig}" in flag(found, "signals-to-handle").split(",")
        else:  # no torchrun: the tasks get the signal from srun themselves
            assert found == []
            check_chain(spec, None, int(warning), f"slurm {mode}")
        # the useless export is gone (torchrun overwrites it from its flag)
        assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in text and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in text


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_kubernetes_every_kind(case: str, kind: str) -> None:
    spec = make(case, k8s={"kind": kind})
    rendered = render(spec, "k8s")
    docs = [d for d in yaml.safe_load_all(rendered.files[kubernetes.filename(spec)]) if d]
    pods = kubernetes.pod_specs(docs, kind)
    assert pods
    for pod in pods:
        if kind == "trainjob":  # the launch line is the trainer's; the pod fields are the runtime patch's
            argv = docs[0]["spec"]["trainer"]["command"]
        else:
            (container,) = pod["containers"]
            argv = [*(container.get("command") or []), *(container.get("args") or [])]
        check_chain(spec, shutdown_of(argv), pod["terminationGracePeriodSeconds"], f"{kind} pod")


@pytest.mark.parametrize("case", CASES)
def test_ssh_launcher(case: str, tmp_path: Path) -> None:
    spec = make(case, ssh={"hosts": ["a", "b"]})
    text = render(spec, "ssh").files["launch.sh"]
    interrupt_s = int(re.search(r"^INTERRUPT_TICKS=(\d+)$", text, re.M).group(1)) / 10  # type: ignore[union-attr]
    check_chain(spec, shutdown_of(words_in(text)), interrupt_s, "launch.sh after Ctrl-C")
    # after a failure the stop payload keeps ssh.grace_s (fail fast)
    assert '"${DDPKIT_STOP_TICKS:-50}"' in text


@pytest.mark.parametrize("case", CASES)
def test_compose(case: str) -> None:
    spec = make(case, device="cpu")
    (name,) = render(spec, "compose").files
    compose = yaml.safe_load(render(spec, "compose").files[name])
    for service in compose["services"].values():
        grace = int(service["stop_grace_period"].removesuffix("s"))
        check_chain(spec, shutdown_of(service["command"]), grace, "compose stop_grace_period")


@pytest.mark.parametrize("case", CASES)
def test_launchers_interrupt_grace(case: str, tmp_path: Path) -> None:
    """launch local/docker/ssh give an interrupt spec.grace.launcher_grace_s
    (a failure keeps --grace / ssh.grace_s: tests/test_launch_* and
    bench/teardown_local.py time that path)."""
    spec = make(case, device="cpu", master_port=29999)
    (node, _) = local.build_nodes(spec, tmp_path)
    check_chain(spec, shutdown_of(node.argv), spec.grace.launcher_grace_s, "launch local after Ctrl-C")


def test_the_trainer_stops_on_what_torchrun_forwards() -> None:
    assert {s.name for s in signals.STOP_SIGNALS} == set(TRAINER_STOP_SIGNALS)


# ---- which stop requeues the Slurm job: preemption.signal only, never a user's scancel (SIGTERM) ----
@pytest.mark.parametrize(("case", "requeue", "exported"), [
    ("default", True, "USR2"), ("term-signal", True, "TERM"), ("default", False, "''")])
def test_the_slurm_script_tells_the_trainer_which_signal_requeues(case: str, requeue: bool, exported: str) -> None:
    for mode in ("torchrun", "srun"):
        text = render(make(case, slurm={"mode": mode, "requeue": requeue}), "slurm").files["chain.sbatch"]
        assert f"\nexport DDPKIT_SLURM_REQUEUE_ON={exported}\n" in text, text


@pytest.mark.parametrize(("env", "stopped_by", "requeued"), [
    ({}, "SIGUSR2", True),  # a script of the user's own: the time limit's warning (--signal=B:USR2@N)
    ({}, "SIGTERM", False),  # ... and a user's scancel
    ({"DDPKIT_SLURM_REQUEUE_ON": "USR2"}, "SIGUSR2", True),
    ({"DDPKIT_SLURM_REQUEUE_ON": "USR2"}, "SIGTERM", False),
    ({"DDPKIT_SLURM_REQUEUE_ON": "TERM"}, "SIGTERM", True),
    ({"DDPKIT_SLURM_REQUEUE_ON": ""}, "SIGUSR2", False),  # slurm.requeue: false
    ({"DDPKIT_SLURM_REQUEUE_ON": ""}, "SIGTERM", False),
])
def test_the_trainer_requeues_only_after_the_signal_that_asks_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], stopped_by: str, requeued: bool) -> None:
    calls = tmp_path / "calls"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "scontrol $*" >> {calls}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}:/usr/bin:/bin")  # subprocess finds scontrol through it
    said: list[str] = []
    asked = signals.requeue_if_slurm(int(getattr(signal_module, stopped_by)), said.append, {"SLURM_JOB_ID": "77", **env})
    assert asked is requeued
    assert (calls.read_text() if calls.exists() else "") == ("scontrol requeue 77\n" if requeued else "")
    [line] = said
    if requeued:
        assert line == "requeueing Slurm job 77 (scontrol requeue); this run ends here"
    else:
        assert line.startswith(f"not requeueing Slurm job 77: stopped by {stopped_by}, and "), line


def test_no_slurm_job_no_requeue() -> None:
    said: list[str] = []
    assert not signals.requeue_if_slurm(int(signal_module.SIGUSR2), said.append, {})
    assert said == []


@pytest.mark.parametrize(("fields", "message"), [
    ({"preemption": {"checkpoint_s": 60}, "k8s": {"termination_grace_s": 30}},
     "k8s.termination_grace_s=30 must exceed torchrun's --shutdown-timeout of 75 s (preemption.checkpoint_s=60 "
     "plus 15 s) or the workers are killed before their checkpoint is written; raise it (derived: 90), lower "
     "preemption.checkpoint_s, or remove it to derive it"),
    ({"preemption": {"checkpoint_s": 300}, "slurm": {"signal_seconds": 300}},
     "slurm.signal_seconds=300 must exceed torchrun's --shutdown-timeout of 315 s"),
    ({"k8s": {"termination_grace_s": 4}},
     "a scheduler warning of 4 s leaves no time for a checkpoint; raise it, or set preemption.checkpoint_s"),
    ({"preemption": {"signal": "USR1"}}, "Input should be 'USR2' or 'TERM'"),
])
def test_a_chain_that_cannot_hold_is_one_line_with_its_fix(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec(name="chain", **fields)
    (problem,) = err.value.errors()
    assert message in problem["msg"] and "\n" not in problem["msg"]
