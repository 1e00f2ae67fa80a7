"""`ddpkit report RUN` (docs/guides/runs.md): the page of a real `launch local`
run, opened in headless Chromium; the screenshot's pixels must show the
plots where the page puts them, and Chromium's own network log must show
no request made by the page. Units: the records a report reads (stalls
and stragglers marked on their ranks), and a run without metrics refused
in one line."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from matplotlib import colormaps
from PIL import Image

from ddpkit import records
from ddpkit.report import data as report_data
from ddpkit.report import plots
from ddpkit.runs import RunFolder, StoredRun, all_runs
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.chromium import CHROMIUM, HEADLESS, needs_chromium
from tests.helpers.runs import TINY
from tests.test_runs import ddpkit

WIDTH, HEIGHT = 1200, 2400
_URL = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?!data:)([a-z][a-z0-9+.-]*:)?//""", re.IGNORECASE)


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return int(hex_color[1:3], 16), int(hex_color[3:5], 16), int(hex_color[5:7], 16)


def _rows_of(image: Image.Image, want: list[tuple[int, int, int]], tolerance: int = 12) -> list[int]:
    """The row of every pixel within `tolerance` of one of the colours."""
    px = image.convert("RGB").load()
    assert px is not None
    rows = []
    for y in range(image.height):
        for x in range(0, image.width, 2):  # every other column: enough, and twice as fast
            r, g, b = px[x, y]
            if any(abs(r - c[0]) <= tolerance and abs(g - c[1]) <= tolerance and abs(b - c[2]) <= tolerance
                   for c in want):
                rows.append(y)
    return rows


def _median(rows: list[int]) -> int:
    return sorted(rows)[len(rows) // 2]


def _screenshot(page: Path, out: Path, tmp: Path) -> list[str]:
    """Chromium's screenshot of the page, and the URLs the page itself asked
    the network for (its net log: the browser's own update and account
    checks have no origin; what a page asks for has the page's file:// origin)."""
    net_log = tmp / "net.json"
    assert CHROMIUM is not None
    done = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={tmp / 'profile'}", f"--log-net-log={net_log}",
                           f"--screenshot={out}", f"--window-size={WIDTH},{HEIGHT}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and out.is_file(), done.stderr[-2000:]
    log = json.loads(net_log.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    asked = []
    for event in log["events"]:
        params = event.get("params") or {}
        if event["type"] == start and "url" in params and (params.get("initiator") != "not an origin"
                                       or str(params.get("network_isolation_key", "")).startswith("file:")):
            asked.append(str(params.get("url")))
    return [u for u in asked if not u.startswith(("data:", "file:"))]


@dataclass(frozen=True)
class Finished:
    runs_dir: Path
    run: StoredRun
    board: Path  # its --tensorboard DIR


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """One real launch local run (2 nodes x 1 process, 16 steps), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("report")
    runs_dir, board = tmp / "runs", tmp / "board"
    done = ddpkit(runs_dir, "launch", "local", "--nodes", "2", "--nproc-per-node", "1", "--grace", "3",
                  "--set", "name=rep", "--", *TINY, "--data", "synthetic", "--synthetic-size", "64", "--batch-size", "4",
                  "--epochs", "2", "--eval-size", "16", "--log-every", "2", "--tensorboard", str(board), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = all_runs(runs_dir)
    return Finished(runs_dir, run, board)


@pytest.mark.slow
def test_tensorboard_gets_the_same_scalars_from_rank_0_only(finished: Finished) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = finished.board.glob("events.out.tfevents.*")  # one writer: rank 0's
    board = EventAccumulator(str(events))
    board.Reload()
    written = [s.record for s in records.read_file(finished.run.folder.metrics_file)]

    def seen(tag: str) -> list[tuple[int, float]]:
        return [(e.step, pytest.approx(e.value, rel=1e-6)) for e in board.Scalars(tag)]

    train = [r for r in written if isinstance(r, records.Train)]
    assert len(train) == 8 and seen("train/loss") == [(r.step, r.loss) for r in train]
    assert seen("train/images_per_s") == [(r.step, r.images_per_s) for r in train]
    windows = [r for r in written if isinstance(r, records.StepTimes)]
    for rank in (0, 1):
        assert seen(f"step_time_ms/rank{rank}") == [(r.step, r.step_s[rank] * 1000) for r in windows]
    assert seen("eval/accuracy") == [(r.step, r.accuracy) for r in written if isinstance(r, records.Eval)]


@needs_chromium
@pytest.mark.slow
def test_report_of_a_real_run_shows_its_plots_in_chromium_and_asks_the_network_nothing(
        finished: Finished, tmp_path: Path) -> None:
    runs_dir, run = finished.runs_dir, finished.run
    metrics = run.folder.metrics_file  # launch local has ddpkit train write its records there
    # A straggler judge's record naming rank 1 in the 5th window: the page must box it there.
    windows = [s for s in records.read_file(metrics) if isinstance(s.record, records.StepTimes)]
    records.append(metrics, _straggler(1, 0.2, 0.1), windows[4].time)

    made = ddpkit(runs_dir, "report", "rep")  # found by the job's name, as `status` finds it
    assert made.returncode == 0, made.stderr
    page = run.folder.path / "report.html"
    assert made.stdout.startswith(f"ddpkit report: wrote {page} (8 train and 8 step-time records"), made.stdout
    html = page.read_text()
    assert not _URL.findall(html) and "<script" not in html and "url(" not in html, "the page refers to something"
    embedded = re.findall(r'<img id="(\w+)"[^>]* src="data:image/png;base64,([^"]+)"', html)
    assert [name for name, _ in embedded] == ["curves", "heatmap", "timeline"]
    for name, b64 in embedded:  # the PNGs beside the page are the ones it embeds
        assert (run.folder.path / f"report-{name}.png").read_bytes() == base64.b64decode(b64)

    shot = tmp_path / "shot.png"
    assert _screenshot(page, shot, tmp_path) == []
    image = Image.open(shot)
    assert image.size == (WIDTH, HEIGHT)
    loss = _rows_of(image, [_rgb(plots.LOSS)])
    throughput = _rows_of(image, [_rgb(plots.THROUGHPUT)])
    viridis = [tuple(round(255 * v) for v in colormaps["viridis"](i)[:3]) for i in range(0, 256, 8)]
    heat = _rows_of(image, viridis, tolerance=6)  # type: ignore[arg-type]
    straggler = _rows_of(image, [_rgb(plots.color("straggler"))])
    assert len(loss) > 200 and len(throughput) > 200 and len(heat) > 20000, (len(loss), len(throughput), len(heat))
    # In the page's order: loss above throughput above the heat map, the straggler's box inside the heat map.
    assert _median(loss) < _median(throughput) < _median(heat)
    assert len(straggler) > 100 and min(heat) <= _median(straggler) <= max(heat)

    # The detector above can fail: a page that does load something is caught.
    canary = tmp_path / "canary.html"
    canary.write_text('<html><body><img src="http://127.0.0.1:9/x.png"><p>x</p></body></html>')
    assert _screenshot(canary, tmp_path / "canary.png", tmp_path / "c") == ["http://127.0.0.1:9/x.png"]


def _straggler(rank: int, own_s: float, median_s: float) -> records.Straggler:
    return records.Straggler(state="slow", rank=rank, node=rank, host=f"h{rank}", step=5, own_s=own_s,
                             median_s=median_s, ratio=own_s / median_s, factor=1.33, window_steps=10)


def test_stalls_and_stragglers_are_marked_on_their_ranks(tmp_path: Path) -> None:
    folder = RunFolder.create(name="marks", target="local", nodes=2, nproc_per_node=1, spec_yaml="name: marks\n",
                              root=tmp_path)
    t0 = folder.record().started
    lines: list[tuple[float, records.Record]] = [
        (t0 + 1, records.RankRow(r, 0, r, f"h{r}", 10 + r, "cpu", None, None, "2", None, None, "torchrun"))
        for r in (0, 1)]
    lines += [(t0 + 2 + i, records.Train(step=2 * i, loss=2.0 - i / 10, images_per_s=100.0)) for i in range(1, 4)]
    lines += [(t0 + 2 + i, records.StepTimes(step=2 * i, step_s=(0.01, 0.01 * i))) for i in range(1, 4)]
    stalled = records.StalledRank(0, 0, "h0", 10, 6, "forward", 60.0, None)
    lines += [(t0 + 4.5, _straggler(1, 0.03, 0.01)),
              (t0 + 6, records.Stall(60.0, 60.0, (stalled,), (1,), (), "stderr")),
              (t0 + 7, records.Stop(signal="SIGUSR2", step=6, checkpoint="/c/step6", slurm_restart_count=0))]
    text = "".join(records.encode(r, t) + "\n" for t, r in lines)
    # A record of a kind this reader does not know, and a line cut short (a killed job): left out.
    (folder.path / "metrics.jsonl").write_text(text + '{"kind": "later", "v": 1}\n{"kind": "tra')
    stored = all_runs(tmp_path)[0]

    data = report_data.load(stored)
    assert [(m.kind, m.ranks) for m in data.marks] == [("start", ()), ("straggler", (1,)), ("stall", (0,)),
                                                        ("preempted", ())]
    from ddpkit.report.page import rank_rows, render

    rows = rank_rows(data)
    assert [(row.rank, row.node_rank, row.host) for row in rows] == [(0, "0", "h0"), (1, "1", "h1")]
    assert [(row.straggler_at, row.stalled_at) for row in rows] == [("", "6.0s"), ("4.5s", "")]
    assert (rows[1].mean_ms, rows[1].slowest_ms) == ("20.0", "30.0")  # mean and slowest window, ms
    html = render(data, {"curves": b"c", "heatmap": b"h", "timeline": b"t"})
    assert ('<td>1</td><td>1</td><td>h1</td><td>11</td><td>cpu</td><td>20.0</td><td>30.0</td>'
            '<td><span class="flag">4.5s</span></td><td>-</td></tr>') in html
    assert '<td>-</td><td><span class="flag">6.0s</span></td></tr>' in html
    assert '<img id="heatmap" alt="per-rank step-time heat map" src="data:image/png;base64,aA==">' in html
    assert html.endswith("</tbody></table>\n</body></html>\n")


def test_the_page_escapes_what_the_records_say(tmp_path: Path) -> None:
    folder = RunFolder.create(name="esc", target="local", nodes=1, nproc_per_node=1, spec_yaml="name: esc\n",
                              root=tmp_path)
    t0 = folder.record().started
    lines = [{"kind": "rank_report", "time": t0 + 1, "rank": 0, "local_rank": 0, "node_rank": 0, "host": "<b>h</b>",
              "pid": 1, "device": "cpu", "interface": None, "address": None, "torch": "2", "cuda": None, "nccl": None,
              "launcher": "torchrun"},
             {"kind": "train", "time": t0 + 2, "step": 1, "loss": 1.0, "images_per_s": 1.0}]
    (folder.path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    from ddpkit.report.page import render

    html = render(report_data.load(all_runs(tmp_path)[0]), {"curves": b"c", "heatmap": b"h", "timeline": b"t"})
    assert "<td>&lt;b&gt;h&lt;/b&gt;</td>" in html and "<b>" not in html


def test_a_run_without_metrics_is_one_line(tmp_path: Path) -> None:
    folder = RunFolder.create(name="bare", target="local", nodes=1, nproc_per_node=1, spec_yaml="name: bare\n",
                              root=tmp_path)
    done = ddpkit(tmp_path, "report", "bare")
    assert done.returncode == ExitCode.FAILED and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"ddpkit report: run {folder.record().id} has no metrics records (looked in {folder.path / 'metrics.jsonl'}); "
        f"run the job with `-- --metrics {folder.path / 'metrics.jsonl'}`, or name the file with --metrics FILE"]


def test_without_matplotlib_the_report_says_what_to_install(tmp_path: Path) -> None:
    # matplotlib is an extra (`ddpkit[report]`); None in sys.modules makes its import fail as if absent.
    code = "import sys; sys.modules['matplotlib'] = None; from ddpkit.cli import main; sys.exit(main(['report', 'x']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DDPKIT_RUNS_DIR": str(tmp_path)})
    assert done.returncode == ExitCode.PREFLIGHT
    assert done.stderr.splitlines() == [
        "ddpkit report: needs matplotlib, which is not installed here: pip install 'ddpkit[report]'"]


def test_tensorboard_without_its_package_is_one_line_and_exit_2() -> None:
    # The package is an extra (`ddpkit[tensorboard]`); None in sys.modules makes it absent.
    code = ("import sys; sys.modules['tensorboard'] = None; from ddpkit.cli import main; "
            "sys.exit(main(['train', '--tensorboard', '/nonexistent/tb', '--max-steps', '1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == ExitCode.BAD_INPUT and not Path("/nonexistent/tb").exists()
    assert done.stderr.splitlines() == [
        "ddpkit train: invalid options (nothing was started): --tensorboard /nonexistent/tb: the tensorboard "
        "package is not installed here; pip install 'ddpkit[tensorboard]' (or drop the flag)"]


def test_a_slurm_runs_records_folder_is_its_metrics_when_it_has_no_metrics_file(tmp_path: Path) -> None:
    """A program of the user's own under `submit slurm` sends its metrics on the records
    channel (each node's file in `<name>-<jobid>.records/` beside the script): the report
    reads the metrics kinds there, across the nodes' files, in time order; a worker's exit
    is the launcher's, not a metrics record."""
    from ddpkit.runs import SlurmJob

    folder = RunFolder.create(name="own", target="slurm", nodes=2, nproc_per_node=1, spec_yaml="name: own\n",
                              root=tmp_path / "runs")
    folder.set_slurm(SlurmJob(job_id=9, script=str(tmp_path / "own.sbatch"), output=str(tmp_path / "own-9.out"),
                              tasks_per_node=1, rank_per_task=False, signal="USR2", signal_grace_s=90))
    t0 = folder.record().started
    kept = records.slurm_folder(tmp_path, "own", 9)
    for i in range(1, 4):
        records.append(kept / "node1.jsonl", records.Train(step=i, loss=2.0 - i / 10, images_per_s=50.0), t0 + i)
        records.append(kept / "node1.jsonl", records.StepTimes(step=i, step_s=(0.01, 0.02)), t0 + i)
    records.append(kept / "node2.jsonl", records.WorkerExit(1, 0, 77, 12), t0 + 2.5)
    records.append(kept / "node2.jsonl", records.Stop("SIGUSR2", 3, "/c/ckpt-3.pt", 0), t0 + 3.5)
    (stored,) = all_runs(tmp_path / "runs")
    data = report_data.load(stored)
    assert data.metrics_path == kept
    assert [p["step"] for p in data.train] == [1, 2, 3] and [p["step"] for p in data.step_times] == [1, 2, 3]
    assert [m.kind for m in data.marks] == ["start", "preempted"]


def test_a_compose_runs_copied_records_are_drawn(tmp_path: Path) -> None:
    """A program of the user's own from the rendered compose file keeps its records in each
    container; `ddpkit report` copies them into the run folder (`records/<service>.jsonl`).
    Once the containers are gone (`docker compose down`, or no daemon here) the copy made
    before is drawn, and one line says so. With real containers: tests/test_report_compose.py."""
    from ddpkit.runs import Applied

    folder = RunFolder.create(name="own", target="compose", nodes=2, nproc_per_node=1, spec_yaml="name: own\n",
                              root=tmp_path)
    folder.update(applied=Applied(tool="compose", files=[str(tmp_path / "compose.yaml")], project="own-gone"))
    t0 = folder.record().started
    for node in ("node0", "node1"):
        for i in range(1, 4):
            records.append(folder.records_folder / f"{node}.jsonl", records.StepTimes(step=i, step_s=(0.01, 0.02)),
                           t0 + i)
    records.append(folder.records_folder / "node0.jsonl", records.Train(step=3, loss=1.5, images_per_s=40.0), t0 + 3)
    done = ddpkit(tmp_path, "report", "own")
    assert done.returncode == ExitCode.OK, done.stderr
    assert "(1 train and 6 step-time records" in done.stdout, done.stdout
    [said] = done.stderr.splitlines()
    assert said.startswith("ddpkit report: ") and said.endswith("; using the records copied from them before"), said
    assert (folder.path / "report.html").is_file()
