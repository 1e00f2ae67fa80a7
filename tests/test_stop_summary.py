"""A run stopped by Ctrl-C or `ddpkit cancel` says whether the job wrote a
checkpoint on that stop: each stopped node's status reads `stopped,
checkpoint at step N` (the job's `stop` record, from ddpkit train or from the
preamble of a program with a stop handler, named a checkpoint) or `stopped,
no checkpoint`, and so do the closing line, run.json and `ddpkit status`.
Units on scripted nodes; one end-to-end run of ddpkit train under `launch
local`, stopped with SIGINT mid-run."""

from __future__ import annotations

import _thread
import io
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from ddpkit import records
from ddpkit.launch.supervise.nodeoutput import LinePrinter
from ddpkit.launch.supervise.summary import RunText
from ddpkit.launch.supervise.supervisor import Supervisor
from ddpkit.runs import RunFolder, RunState, all_runs
from ddpkit.shared.exitcodes import ExitCode
from tests.test_supervisor_rejoin import WAIT_S, ScriptedNode

ROOT = Path(__file__).resolve().parents[1]


class StoppedNode(ScriptedNode):
    """A node whose job, asked to stop, prints `lines` (its stop record) and ends 1 (torchrun's agent)."""

    def __init__(self, index: int, lines: list[str]) -> None:
        super().__init__(index)
        self.lines = lines
        self.printer: LinePrinter | None = None

    def start(self, printer: LinePrinter, exited: Callable[[], None]) -> None:
        self.printer = printer
        super().start(printer, exited)

    def stop(self, grace_s: float) -> str | None:
        if self.code is None and self.printer is not None:
            for line in self.lines:
                self.printer.line(self, line)
            self.finish(1)
        return super().stop(grace_s)


def interrupted_run(tmp_path: Path, node0_prints: list[str]) -> tuple[str, RunFolder]:
    """Two nodes; Ctrl-C once both run; node 0 prints `node0_prints` as it stops."""
    folder = RunFolder.create(name="stop", target="local", nodes=2, nproc_per_node=1, spec_yaml="", root=tmp_path)
    nodes = [StoppedNode(0, node0_prints), StoppedNode(1, [])]
    out = io.StringIO()
    sup = Supervisor(nodes, Console(file=out, width=300), 1.0, run=folder)

    def ctrl_c() -> None:
        assert all(n.started.wait(WAIT_S) for n in nodes)
        _thread.interrupt_main()  # SIGINT's handler in the main thread: KeyboardInterrupt inside run()

    threading.Thread(target=ctrl_c, daemon=True).start()
    outcome = sup.run()
    assert outcome.interrupted and outcome.code == ExitCode.INTERRUPTED
    sup.summary(outcome, RunText("launch local", "interrupted; stopped all nodes"))
    folder.finish(outcome.code, folder.record().summary)
    return out.getvalue(), folder


def stop_record(checkpoint: str | None, step: int = 28) -> str:
    return "[rank0]:" + records.frame(records.Stop("SIGTERM", step, checkpoint, 0))


@pytest.mark.parametrize(("printed", "said"), [
    ([stop_record("/ck/ckpt-00000028.pt")], "checkpoint at step 28"),
    ([stop_record("saved by the program's stop handlers", 40)], "checkpoint at step 40"),
    ([stop_record(None)], "no checkpoint"),  # ddpkit train with no --checkpoint-dir
    ([], "no checkpoint"),  # a program without a stop handler: no record
], ids=["ddpkit-train", "on-stop", "train-without-dir", "no-handler"])
def test_a_stopped_run_says_whether_it_checkpointed(tmp_path: Path, printed: list[str], said: str) -> None:
    text, folder = interrupted_run(tmp_path, printed)
    summary = folder.record().summary
    assert summary is not None
    assert [row.status for row in summary.rows] == [f"stopped, {said}"] * 2, summary.rows
    assert summary.closing == f"launch local: interrupted; stopped all nodes; {said}"
    assert text.count(f"stopped, {said}") == 2 and summary.closing in text, text
    assert "@@ddpkit-record" not in text, text
    interrupted = next(e for e in folder.events() if e.kind == "interrupted")  # `ddpkit status` lists the events
    assert interrupted.detail.endswith(f"s grace; {said}"), interrupted


def test_the_status_cell_keeps_the_stopped_style() -> None:
    from ddpkit.launch.supervise.summary import STATUS_STYLE, SummaryStatus, status_style

    assert status_style("stopped, checkpoint at step 3") == STATUS_STYLE[SummaryStatus.STOPPED]
    assert status_style("failed, excluded") == STATUS_STYLE[SummaryStatus.EXCLUDED]
    assert status_style("ok") == STATUS_STYLE[SummaryStatus.OK]


TINY = ["--model=tiny", "--data=synthetic", "--image-size=16", "--synthetic-size=32", "--batch-size=8",
        "--epochs=100000", "--workers=0", "--no-eval", "--log-every=1", "--progress=plain"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_on_ddpkit_train_reads_stopped_with_its_checkpoint_step(tmp_path: Path) -> None:
    """2 nodes x 1 process of ddpkit train's tiny model; SIGINT to the launcher
    once rank 0 has stepped: its checkpoint's step is in the summary, `ddpkit
    status RUN` and run.json."""
    runs = tmp_path / "runs"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DDPKIT_", "RANK", "WORLD"))},
           "DDPKIT_RUNS_DIR": str(runs)}
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "local", "--nodes", "2", "--nproc-per-node", "1",
            "--grace", "10", "--", *TINY, f"--checkpoint-dir={tmp_path / 'ck'}"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout is not None
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("[node0 rank0] step 3/"):
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen) + rest
    assert proc.returncode == ExitCode.INTERRUPTED, text[-3000:]
    (run,) = all_runs(runs)
    record = run.folder.record()
    assert record.state is RunState.CANCELLED and record.summary is not None, record
    step = _checkpoint_step(text)
    assert (tmp_path / "ck" / f"ckpt-{step:08d}.pt").is_file(), sorted((tmp_path / "ck").iterdir())
    said = f"checkpoint at step {step}"
    assert [row.status for row in record.summary.rows] == [f"stopped, {said}"] * 2, record.summary.rows
    assert record.summary.closing == f"launch local: interrupted; stopped all nodes; {said}"
    assert text.rstrip().splitlines()[-1] == record.summary.closing, text[-2000:]
    assert text.count(f"stopped, {said}") == 2, text[-2000:]
    status = subprocess.run([sys.executable, "-m", "ddpkit.cli", "status", record.id], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert status.stdout.count(f"stopped, {said}") == 2 and record.summary.closing in status.stdout, status.stdout


def _checkpoint_step(text: str) -> int:
    """The step rank 0 checkpointed at, from its summary's `checkpoint .../ckpt-<step>.pt` line."""
    line = next(ln for ln in text.splitlines() if ln.startswith("[node0 rank0]   checkpoint "))
    return int(line.rsplit("ckpt-", 1)[1].removesuffix(".pt"))


def test_a_resumed_trainer_s_stop_record_names_its_global_step(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A Hugging Face Trainer resumed from checkpoint-40 stops after 10 more
    optimizer steps of this process: it saves checkpoint-50, and the record the
    launcher reads (`stopped, checkpoint at step N`) says 50, not 10."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ddpkit.frameworks.hf import StopCallback
    from ddpkit.preamble import stop

    for name in ("SLURM_JOB_ID", "DDPKIT_METRICS", "RANK"):
        monkeypatch.delenv(name, raising=False)
    # A state of its own, already installed: no signal handler or optimizer hook is left in this process.
    monkeypatch.setattr(stop, "STATE", stop.StopState(installed=True))
    callback = StopCallback()
    stop.STATE.agreed, stop.STATE.steps = int(signal.SIGTERM), 10  # 10: its optimizer steps since it resumed
    with pytest.raises(SystemExit) as ended:
        callback.on_train_end(TrainingArguments(output_dir="unused", report_to=[]), TrainerState(global_step=50),
                              TrainerControl())
    assert ended.value.code == ExitCode.PREEMPTED
    (framed,) = [ln for ln in capsys.readouterr().err.splitlines() if records.is_frame(ln)]
    stamped = records.unframe(framed)
    assert stamped is not None and isinstance(stamped.record, records.Stop), framed
    assert (stamped.record.step, stamped.record.checkpoint) == (50, "saved by the program's Trainer")
