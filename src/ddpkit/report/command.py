"""`ddpkit report RUN [-o FILE] [--metrics FILE]`: the run's page and its
PNGs (docs/guides/runs.md, "ddpkit report"). RUN is found the way `ddpkit status`
finds it (ddpkit.runs.resolve); the page goes into the run folder unless -o
names a file, and the PNGs beside it (<stem>-curves.png, ...). A rendered
compose job's records are in its containers: they are copied into the run
folder first, while `docker compose down` has not removed them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..runs import RunTarget, StoredRun, UnknownRun, resolve
from ..shared.exitcodes import ExitCode, exit_on

WHO = "ddpkit report"
DEFAULT_NAME = "report.html"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run id, a job name (its latest run) or a Slurm job id")
    parser.add_argument("-o", "--output", type=Path, metavar="FILE",
                        help=f"the HTML file (default: {DEFAULT_NAME} in the run folder); the PNGs go beside it")
    parser.add_argument("--metrics", type=Path, metavar="FILE",
                        help="the job's metrics JSONL (default: metrics.jsonl in the run folder, else the "
                             "--metrics path of the job's command)")


def run(args: argparse.Namespace) -> int:
    from .data import NoMetrics

    try:
        import matplotlib  # noqa: F401  (an extra: the training image has no use for it)
    except ImportError:
        return exit_on(WHO, "needs matplotlib, which is not installed here: pip install 'ddpkit[report]'",
                       ExitCode.PREFLIGHT)
    try:
        return _report(args)
    except UnknownRun as exc:
        return exit_on(WHO, exc, ExitCode.BAD_INPUT)
    except NoMetrics as exc:
        return exit_on(WHO, exc, ExitCode.FAILED)
    except OSError as exc:  # the output folder cannot be written
        return exit_on(f"{WHO}: cannot write the report", exc, ExitCode.FAILED)


def _report(args: argparse.Namespace) -> int:
    from . import data, page, plots  # matplotlib: only when a report is made

    stored = resolve(args.run)
    if args.metrics is None:
        _copy_records(stored)
    found = data.load(stored, args.metrics)
    html_path: Path = args.output or stored.folder.path / DEFAULT_NAME
    figures = {"curves": plots.curves(found), "heatmap": plots.heatmap(found), "timeline": plots.timeline(found)}
    html_path.parent.mkdir(parents=True, exist_ok=True)
    for name, png in figures.items():
        (html_path.parent / f"{html_path.stem}-{name}.png").write_bytes(png)
    html_path.write_text(page.render(found, figures), encoding="utf-8")
    print(f"ddpkit report: wrote {html_path} ({len(found.train)} train and {len(found.step_times)} step-time "
          f"records, {len(found.marks)} events; PNGs beside it)")
    return ExitCode.OK


def _copy_records(stored: StoredRun) -> None:
    """A rendered job's records, brought into the run folder: a compose job's
    from its containers, a Kubernetes job's from its shared volume; where they
    cannot be (the containers removed), an earlier copy serves."""
    if stored.record.target not in (RunTarget.COMPOSE, RunTarget.K8S) or stored.record.applied is None:
        return
    from ..launch.control.backends import compose, kubectl

    k8s = stored.record.target is RunTarget.K8S
    try:
        (kubectl.copy_records if k8s else compose.copy_records)(stored)
    except compose.NoRecords as exc:
        if not any(stored.folder.records_folder.glob("*.jsonl")):
            from .data import NoMetrics

            where = "the job's volume is readable" if k8s else "the containers are there"
            raise NoMetrics(f"{exc}; `ddpkit report` copies them while {where}") from None
        print(f"{WHO}: {exc}; using the records copied from them before", file=sys.stderr)
