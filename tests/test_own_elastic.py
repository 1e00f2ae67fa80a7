"""A program of the user's own as an elastic job under `ddpkit launch local`
(3 nodes x 1 process, min_nodes 2, gloo): the PyTorch tutorial's script, a
Hugging Face `Trainer` script and a Lightning `Trainer` script, each as it
is, with no call into ddpkit. Once the program's own checkpoint is on disk,
node 2's agent and worker are SIGKILLed: the survivors' agents re-form the
job without it, the program starts again on 2 nodes and resumes from its own
checkpoint, the job exits 0, and the launcher's summary and closing line say
node 2 failed and was excluded."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpkit.launch.supervise import proctree
from tests.helpers.elastic_gate import local_node_agent
from tests.helpers.tiers import one_case_in_ci
from tests.test_preamble import TUTORIAL, Job
from tests.test_startup import ROOT

HELPERS = ROOT / "tests" / "helpers"
ELASTIC = ("--nodes", "3", "--set", "elastic.min_nodes=2", "--set", "elastic.max_restarts=2",
           "--set", "elastic.max_node_failures=1", "--set", "env.STEP_SLEEP_S=0.05")


class Program:
    """A script, its arguments in `tmp`, the file its first checkpoint writes
    and the line it prints when it starts from a checkpoint."""

    def __init__(self, script: Path, args: Callable[[Path], list[str]], saved: Callable[[Path], Path],
                 resumed: str) -> None:
        self.script, self.args, self.saved, self.resumed = script, args, saved, resumed


PROGRAMS = {
    "tutorial": Program(TUTORIAL, lambda t: ["25", "1", "--batch_size", "32", "--snapshot", str(t / "snapshot.pt"),
                                             "--step-sleep", "0.05"],
                        lambda t: t / "snapshot.pt", r"Resuming training from snapshot at Epoch \d+"),
    "hf": Program(HELPERS / "hf_trainer.py", lambda t: [str(t / "hf-out"), "8", "resume"],
                  lambda t: t / "hf-out" / "checkpoint-10" / "trainer_state.json", r"resuming from \S+checkpoint-\d+"),
    "lightning": Program(HELPERS / "lightning_trainer.py", lambda t: [str(t / "lt"), "12", "env", "resume"],
                         lambda t: t / "lt" / "ckpt" / "last.ckpt", r"resuming from \S+last\.ckpt"),
}
pytestmark = pytest.mark.slow


def wait_for_file(path: Path, job: Job, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.proc.poll() is None and time.monotonic() < deadline, f"{path} never written:\n{job.text[-4000:]}"
        time.sleep(0.1)


@pytest.mark.parametrize("name", one_case_in_ci(sorted(PROGRAMS), keep="tutorial"))
def test_a_lost_node_and_the_program_resumes_from_its_own_checkpoint_on_the_two_left(tmp_path: Path,
                                                                                      name: str) -> None:
    program = PROGRAMS[name]
    job = Job(tmp_path, program.script, *program.args(tmp_path), launch=ELASTIC)
    wait_for_file(program.saved(tmp_path), job)
    killed = local_node_agent(job.proc.pid, 2)
    assert killed, f"no agent for node 2:\n{job.text[-4000:]}"
    job.pids |= set(proctree.descendants(job.proc.pid))
    lost_at = time.monotonic()
    proctree.signal_all(killed, signal.SIGKILL)
    job.wait_for(program.resumed, timeout=240)
    resumed_s = time.monotonic() - lost_at
    code = job.finish(300)
    time.sleep(0.1)  # the reader thread takes the last lines
    text = job.text
    flat = " ".join(text.split())
    print(f"OWN-ELASTIC {name}: node 2 SIGKILLed -> the program resumed from its checkpoint {resumed_s:.1f} s later")
    assert code == 0, text[-6000:]
    assert job.left == []
    assert re.search(program.resumed, text), text[-4000:]
    assert "node2 │ 137 │ failed, excluded" in flat, flat[-3000:]
    assert "excluded after it failed; the job went on with 2 of 3 nodes" in flat, flat[-3000:]
    assert text.rstrip().splitlines()[-1].startswith("launch local: every node finished"), text[-800:]
