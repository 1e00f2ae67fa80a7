"""The run key (runkey.py): what it derives, and that it exists only at run
time: no rendered file holds it or anything derived from it, the Slurm batch
script and launch.sh make a fresh one per run and hand the same one to every
task or node, on no command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.contract import RowKey
from ddpkit.launch.docker import plan as docker_plan
from ddpkit.launch.secrets import stdin_payload, with_run_key
from ddpkit.rendezvous import runkey
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import TARGETS, render, sshnode
from tests.helpers.rdzv_id import KEYED, as_run, meets_under

ROOT = Path(__file__).resolve().parents[1]
CANARY = "c4a7" * 16  # 64 hex digits, as a real key


def job(*overrides: str) -> JobSpec:
    return load_spec(None, overrides=["name=rk", "nodes=2", "device=cpu", "ssh.hosts=[h1, h2]", *overrides])


# ---- what it derives ---------------------------------------------------------------


def test_a_key_is_256_random_bits_and_each_run_gets_its_own() -> None:
    keys = {runkey.new_key() for _ in range(100)}
    assert len(keys) == 100 and all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys)


def test_the_control_prefix_needs_the_key_and_does_not_show_it() -> None:
    one, other = runkey.control_prefix({runkey.ENV: CANARY}), runkey.control_prefix({runkey.ENV: CANARY[:-1] + "0"})
    assert one != other and runkey.UNKEYED_PREFIX not in (one, other)
    assert re.fullmatch(r"ddpkit-[0-9a-f]{32}/", one) and CANARY[:16] not in one
    assert one == runkey.control_prefix({runkey.ENV: CANARY})  # every rank of the run derives the same
    # no key, or an empty one: the public prefix of a keyless job
    assert runkey.control_prefix({}) == runkey.control_prefix({runkey.ENV: ""}) == runkey.UNKEYED_PREFIX


def test_the_rendezvous_id_is_tagged_with_the_key() -> None:
    tagged = runkey.rdzv_run_id("job-a1b2", {runkey.ENV: CANARY})
    assert tagged.startswith("job-a1b2-") and tagged == runkey.rdzv_run_id("job-a1b2", {runkey.ENV: CANARY})
    assert tagged != runkey.rdzv_run_id("job-a1b2", {runkey.ENV: runkey.new_key()})
    assert tagged != runkey.rdzv_run_id("job-other", {runkey.ENV: CANARY})
    assert CANARY[:16] not in tagged and runkey.control_prefix({runkey.ENV: CANARY})[7:-1] not in tagged
    assert runkey.rdzv_run_id("job-a1b2", {}) == "job-a1b2"


# ---- no rendered file holds it -----------------------------------------------------------


@pytest.mark.parametrize("target", KEYED)
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_a_fixed_size_jobs_rendezvous_is_under_an_id_only_the_key_forms(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path, target: RowKey,
                                                                        backend: str) -> None:
    """A job of fixed size meets in torchrun's static rendezvous (its rank
    assignment and exit barrier under a prefix the id names, torchrun's
    "none" where the line names none) or torch's c10d (its state under the
    job's name): on a node, the handler ddpkit's agent and torchrun build
    from the line meets under that id tagged with the key."""
    argv, key, public = as_run(job(f"rendezvous.backend={backend}"), target, tmp_path)
    [rendered] = [w.split("=", 1)[1] for w in argv if w.startswith("--rdzv-id=")] or ["none"]
    keyed = runkey.rdzv_run_id(rendered, {runkey.ENV: key})
    assert meets_under(monkeypatch, argv, key) == (backend, keyed) and keyed != rendered
    assert keyed.removeprefix(rendered + "-") not in public and key not in public



def _derived(key: str) -> list[str]:
    env = {runkey.ENV: key}
    return [key, runkey.control_prefix(env)[7:-1], runkey.rdzv_run_id("rk", env)[3:]]


@pytest.mark.parametrize("overrides", [(), ("elastic.min_nodes=1", "k8s.kind=pytorchjob")], ids=["static", "elastic"])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_no_rendered_file_holds_the_key_or_what_it_derives(monkeypatch: pytest.MonkeyPatch, target: str,
                                                           overrides: tuple[str, ...]) -> None:
    # a key in the renderer's own environment, and every key a renderer could make
    monkeypatch.setenv(runkey.ENV, CANARY)
    monkeypatch.setattr(runkey, "new_key", lambda: CANARY)
    rendered = render(job(*overrides), target)
    assert rendered.files
    for name, text in rendered.files.items():
        for secret in _derived(CANARY):
            assert secret not in text, f"{target}/{name} holds {secret}"


def test_no_golden_holds_a_key() -> None:
    goldens = [p for folder in ("slurm", "k8s", "compose", "ssh") for p in (ROOT / folder).glob("*") if p.is_file()]
    assert goldens
    for path in goldens:
        assert not re.search(r"\b[0-9a-f]{64}\b", path.read_text()), path


# ---- it reaches every process, at run time only ----------------------------------------------

SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
for node in 0 1; do SLURM_NODEID=$node "$@" || exit; done
"""
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'node-a\\nnode-b\\n'
"""
# A stand-in for the job's interpreter: appends the key it got (or UNSET) and its argv to KEY_OUT.
KEYPRINT = f"""#!{sys.executable}
import os, sys
with open(os.environ["KEY_OUT"], "a") as out:
    out.write(os.environ.get({runkey.ENV!r}, "UNSET") + " " + " ".join(sys.argv) + "\\n")
"""


@pytest.fixture
def stand_ins(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("keyprint", KEYPRINT)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def _keys(out: Path) -> list[str]:
    return [line.split()[0] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_the_slurm_script_makes_one_key_per_run_for_every_task(tmp_path: Path, stand_ins: Path, mode: str) -> None:
    script = tmp_path / "rk.sbatch"
    script.write_text(render(job(f"slurm.mode={mode}", f"command.python={stand_ins / 'keyprint'}"),
                             "slurm").files["rk.sbatch"])
    runs = []
    for run in range(2):
        out = tmp_path / f"keys{run}"
        env = {"PATH": f"{stand_ins}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-[a-b]",
               "KEY_OUT": str(out)}
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        keys = _keys(out)
        assert len(keys) == 2 and len(set(keys)) == 1, keys  # both tasks, one key
        assert re.fullmatch(r"[0-9a-f]{64}", keys[0])
        assert keys[0] not in done.stdout + done.stderr  # never printed
        assert all(keys[0] not in line.split(" ", 1)[1] for line in out.read_text().splitlines())  # in no argv
        runs.append(keys[0])
    assert runs[0] != runs[1]


FAKE_SSH = """#!/bin/bash
printf '%s\\0' "$@" >> "$SSH_ARGV"
exec sh -c "${@: -1}"
"""


def test_launch_sh_sends_every_node_the_same_fresh_key_on_stdin(tmp_path: Path, stand_ins: Path) -> None:
    (stand_ins / "ssh").write_text(FAKE_SSH)
    (stand_ins / "ssh").chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text(render(job(f"command.python={stand_ins / 'keyprint'}", f"ssh.log_dir={tmp_path / 'logs'}"),
                             "ssh").files["launch.sh"])
    runs = []
    for run in range(2):
        out = tmp_path / f"keys{run}"
        env = {"PATH": f"{stand_ins}:{os.environ['PATH']}", "KEY_OUT": str(out), "SSH_ARGV": str(tmp_path / "argv")}
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        keys = _keys(out)
        assert len(keys) == 2 and len(set(keys)) == 1 and re.fullmatch(r"[0-9a-f]{64}", keys[0]), keys
        assert keys[0] not in done.stdout + done.stderr
        assert keys[0].encode() not in (tmp_path / "argv").read_bytes()  # what `ps` on either side shows
        runs.append(keys[0])
    assert runs[0] != runs[1]


def test_the_ssh_node_script_exports_the_key_it_reads_after_the_secrets(tmp_path: Path, stand_ins: Path) -> None:
    command = sshnode.node_command(job(f"command.python={stand_ins / 'keyprint'}"), 0, "10.0.0.1")
    out = tmp_path / "keys"
    payload = with_run_key({})
    # stdin held open until the node ends, as launch ssh's session does (EOF would stop the node)
    proc = subprocess.Popen(["sh", "-c", command.start], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"PATH": os.environ["PATH"], "KEY_OUT": str(out)})
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(stdin_payload(payload))
    proc.stdin.flush()
    proc.stdout.read()
    try:
        assert proc.wait(30) == 0
    finally:
        proc.stdin.close()
    assert _keys(out) == [payload[runkey.ENV]] and payload[runkey.ENV] not in command.start
    # without it the node does not start
    proc = subprocess.run(["sh", "-c", command.start], input=b"", capture_output=True,
                          env={"PATH": os.environ["PATH"], "KEY_OUT": str(out)}, check=False, timeout=30)
    assert proc.returncode == 2 and proc.stderr.decode().splitlines() == [
        f"ddpkit: secret {runkey.ENV} did not arrive on stdin from the launcher"]


def test_launch_docker_gives_every_container_the_same_key() -> None:
    keys = {p.environment[runkey.ENV] for p in docker_plan(job(), with_run_key({}))}
    assert len(keys) == 1 and re.fullmatch(r"[0-9a-f]{64}", keys.pop())


# ---- a job without a key says so, once ------------------------------------------------------------


class _QuietDog:
    """Stands in for the watchdog thread, which these tests do not run."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def start(self) -> None:
        pass

    def retire(self) -> None:
        pass


@pytest.mark.parametrize(("rank", "addr", "key", "said"), [
    (0, "10.0.0.1", None, True),         # rank 0 of a job on a network store, without a key
    (1, "10.0.0.1", None, False),        # once per job: rank 0 only
    (0, None, None, False),              # --spawn's file store: no network to reach it from
    (0, "10.0.0.1", CANARY, False),      # keyed
])
def test_the_watchdog_says_when_a_job_runs_without_a_key(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], rank: int,
                                                         addr: str | None, key: str | None, said: bool) -> None:
    from ddpkit.train.watchdog import stall
    from ddpkit.train.watchdog.stall_model import Settings

    monkeypatch.setattr(stall, "open_store", lambda *args: None)
    monkeypatch.setattr(stall, "Watchdog", _QuietDog)
    monkeypatch.setattr(stall, "_RUNNING", [])  # the watchdogs this process started: none but this test's
    if key is None:
        monkeypatch.delenv(runkey.ENV, raising=False)
    else:
        monkeypatch.setenv(runkey.ENV, key)
    stall.start(stall.Identity(rank, 2, 1, rank, "h", 1), addr, 29500, stall.Outputs(), Settings(stall_s=60))
    err = capsys.readouterr().err
    assert err.splitlines() == ([runkey.UNKEYED_NOTE] if said else []), err
