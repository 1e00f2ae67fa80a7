"""A stranger on the network against a running job: `ddpkit launch local`,
2 nodes x 1 process of `ddpkit train` (torchrun agents, gloo, CPU). While it
trains, a client of our own opens the job's master port with torch's
TCPStore, as anyone who can reach the port can, and forges ddpkit's control
records: the watchdog's stall verdict (the attack that stopped a job with
exit 13), a node-loss verdict, frozen heartbeats, a straggler's work record,
acknowledgements and the release, under the public prefix every ddpkit used
before run keys and under every prefix a stranger could derive from what
they can see (the job's name, its run id, an empty key). None of it may reach
the job: it trains to the end and exits 0, and no forged name appears in its
output. The same forged verdict under the run's own prefix (the key read
from a worker's environment, as only the job's owner or root can) stops it
with exit 13: the records are real ones, and only the key keeps them out.
And an elastic job's rendezvous state is under no name the stranger can form
from what it sees, only under one derived from the key."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from ddpkit.launch.supervise import proctree
from ddpkit.rendezvous import runkey
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers import store_stranger as stranger
from tests.helpers.elastic_gate import LAST_CALL_S, held_step, release
from tests.helpers.followed import Followed
from tests.helpers.runs import TINY
from tests.test_launch_local import clean_env, launch_argv
from tests.test_startup import ROOT

pytestmark = pytest.mark.slow

WORLD = 2
STALL_S = 6  # the watchdog checks the verdict key every second and judges within stall_s
# rank 0 sleeps this long in each step's data loading: the job trains for at least MAX_STEPS x SLOW_S
SLOW_S, MAX_STEPS = 0.3, 80
AFTER = 20  # steps the job must make after the forgeries: SLOW_S x AFTER is at least STALL_S


class Job:
    """`ddpkit launch local` in the background, its output followed."""

    def __init__(self, tmp: Path) -> None:
        argv = launch_argv("--nodes", "2", "--nproc-per-node", "1", "--grace", "5",
                           "--set", f"watchdog.stall_s={STALL_S}", "--",
                           "--model", "tiny", "--image-size", "8", "--workers", "0", "--progress", "plain",
                           "--log-every", "1", "--data", "synthetic", "--batch-size", "4",
                           "--synthetic-size", "100000", "--eval-size", "16", "--max-steps", str(MAX_STEPS),
                           "--metrics", str(tmp / "metrics.jsonl"))
        self.out = Followed(subprocess.Popen(argv, env=clean_env(DDPKIT_TEST_SLOW_RANK=f"0:{SLOW_S}"), cwd=ROOT,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        self.proc = self.out.proc
        self.pids: set[int] = set()

    @property
    def text(self) -> str:
        return self.out.text

    def last_step(self) -> int:
        return max(self.out.steps(r"\[node0 rank0\].*\bstep (\d+)\b"), default=-1)

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.pids |= set(proctree.descendants(self.proc.pid))
        proctree.signal_all(proctree.alive(sorted(self.pids)), 9)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _started(job: Job) -> tuple[int, str]:
    master = job.out.wait_for(r"master 127\.0\.0\.1:(\d+)")
    run_id = job.out.wait_for(r"ddpkit status (\S+)\)")
    job.out.wait_for(r"\[node0 rank0\].*\bstep 3\b")  # the watchdog is up and every rank has published
    return int(master.group(1)), run_id.group(1)


def test_forged_records_without_the_run_key_do_not_reach_the_job(tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        port, run_id = _started(job)
        said = stranger.forge_everywhere(stranger.connect("127.0.0.1", port),
                                         stranger.guessable_prefixes("ddp-job", run_id), WORLD)
        assert "forged every record" in said, f"{said}\n{job.text}"
        assert job.out.running, f"the job ended during the forgery:\n{job.text}"
        # it trains on, under the watchdog's eye, for AFTER steps more
        job.out.wait_for(rf"\[node0 rank0\].*\bstep {job.last_step() + AFTER}\b", timeout=120)
        code = job.finish(timeout=300)
    finally:
        job.cleanup()
    text = job.text
    assert code == ExitCode.OK, text
    assert stranger.EVIL not in text, text
    # rank 0, slowed on purpose, is rightly a straggler; the forged record named rank 1
    assert "watchdog: STALL" not in text and "watchdog: LOST" not in text and "straggler rank 1" not in text, text
    assert "launch local: every node finished" in text, text


def _run_key(launcher: int) -> str:
    """The run key, from the environment of the launcher's processes (as only
    the job's owner or root can read it)."""
    keys = set()
    for pid in proctree.descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        keys |= {e.split(b"=", 1)[1].decode() for e in environ if e.startswith(runkey.ENV.encode() + b"=")}
    assert len(keys) == 1, f"every process of the run holds one key: {len(keys)} found"
    return keys.pop()


def test_the_same_verdict_under_the_run_key_stops_the_job(tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        port, _ = _started(job)
        key = _run_key(job.proc.pid)
        assert len(key) == 2 * runkey.KEY_BYTES and key not in job.text
        stranger.main(["127.0.0.1", str(port), "--key", key])
        code = job.finish(timeout=120)
    finally:
        job.cleanup()
    text = job.text
    assert code == ExitCode.STALLED, text
    assert f"launch local: the hang watchdog found stalled rank(s): rank 1 (node 1, {stranger.EVIL})" in text, text


def _agent_lines(launcher: int) -> list[list[str]]:
    """The command line of each torchrun agent under the launcher: what `ps` shows anyone on the host."""
    lines = []
    for pid in proctree.descendants(launcher):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if words[1:3] == ["-m", "ddpkit.agent"]:
            lines.append(words)
    return lines


def test_an_elastic_jobs_rendezvous_is_under_no_name_a_stranger_can_form(tmp_path: Path) -> None:
    """An elastic program of the user's own (ddpkit's rendezvous, in the
    store launch local hosts) held after its first checkpoint: the stranger
    finds no rendezvous state under the id on the agents' command lines, the
    job's name or torchrun's default, so it can neither join the rendezvous
    nor close it; under that id tagged with the run key, the state is there."""
    gate, ckpt = tmp_path / "gate", tmp_path / "ckpt"
    gate.mkdir()
    spec = {"name": "elastic-stranger", "nodes": 2, "nproc_per_node": 1, "rendezvous": {"timeout_s": 120},
            "elastic": {"min_nodes": 1, "max_restarts": 0, "last_call_s": LAST_CALL_S},
            "command": {"module": "tests.helpers.elastic_gate",
                        "args": [*TINY, "--synthetic-size", "64", "--batch-size", "4", "--epochs", "1", "--no-eval",
                                 "--checkpoint-every", "4", "--checkpoint-dir", str(ckpt), "--dist-timeout", "60"]},
            "env": {"PYTHONPATH": f"{ROOT}:{ROOT / 'src'}", "ELASTIC_TEST_GATE_DIR": str(gate),
                    "ELASTIC_TEST_GATE_WORLD": "2"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    job = Followed(subprocess.Popen([*launch_argv("-f", str(tmp_path / "job.yaml"))], env=clean_env(), cwd=tmp_path,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        held_step(gate, 2, lambda: None if job.running else job.text[-4000:], timeout=240)
        lines = _agent_lines(job.proc.pid)
        assert len(lines) == 2, lines
        flags = {w.split("=", 1)[0]: w.split("=", 1)[1] for line in lines for w in line if w.startswith("--rdzv-")}
        assert flags["--rdzv-backend"] == "ddpkit", flags
        rendered, (host, port) = flags["--rdzv-id"], flags["--rdzv-endpoint"].rsplit(":", 1)
        key = _run_key(job.proc.pid)
        store = stranger.connect(host, int(port))
        named = [i for i in (rendered, spec["name"], "none") if store.check([f"torch.rendezvous.{i}"])]
        keyed = store.check([f"torch.rendezvous.{runkey.rdzv_run_id(rendered, {runkey.ENV: key})}"])
        release(gate, 2)
        code = job.finish(240)
    finally:
        release(gate, 2)
        if job.running:
            job.proc.kill()
            job.proc.wait()
    assert named == [], f"rendezvous state under a public name: {named}"
    assert keyed, "no rendezvous state under the keyed id: the job met elsewhere"
    assert code == ExitCode.OK, job.text[-4000:]
