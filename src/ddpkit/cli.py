"""`ddpkit ...`: argument parsing and dispatch only; the work lives in the
modules each command names."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .launch.control.applied import record_render, recorded_target
from .render.engine import Rendered, RenderError, TemplatesError
from .runs import RunsDirError, StoredRun
from .shared.exitcodes import ExitCode, exit_on
from .spec import JobSpec, doctor_mode
from .spec.yamlfile import SpecError, add_spec_arguments, spec_from_args, warn_env
from .targets import TARGETS, render
from .train.argcheck import TrainArgsError, check_command, unknown_options_line

# (command words, module, help): the module provides add_arguments(parser)
# and run(args) -> int; or "module:NAME", whose NAME has both (several small
# commands in one module). Command modules import torch inside run(), never
# at module level, so `ddpkit render` and `--help` stay fast.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("env",), "ddpkit.train.startup.envinfo", "print what this process resolved: ranks, master, interface, backend, device"),
    (("launch", "local"), "ddpkit.launch.local", "run the job as N torchrun agents (nodes) on this machine, gloo"),
    (("launch", "ssh"), "ddpkit.launch.ssh.launcher", "start the job on bare-metal hosts over SSH (hostfile order = node rank)"),
    (("launch", "docker"), "ddpkit.launch.docker",
     "run the job as N containers of its image on one Docker network (node0 the master)"),
    (("train",), "ddpkit.train.main", "the DDP training entrypoint (run it under torchrun, srun, mpirun, a pod, or alone)"),
    (("data",), "ddpkit.train.data.download", "download a dataset once into a folder (ddpkit data cifar10 --root DIR)"),
    (("doctor",), "ddpkit.doctor", "preflight checks, collective correctness and (--bench) bandwidth on every rank"),
    (("submit", "slurm"), "ddpkit.launch.slurm.submit",
     "render the job, sbatch it, and (--follow) stream its logs until it ends"),
    (("runs",), "ddpkit.launch.control.commands:RUNS", "list the runs of launch and submit, newest first (docs/guides/runs.md)"),
    (("status",), "ddpkit.launch.control.commands:STATUS",
     "one run's state, events and summary (RUN: id, job name, Slurm job id)"),
    (("logs",), "ddpkit.launch.control.commands:LOGS", "a run's node logs: --node N, --rank R, --tail N, --follow"),
    (("cancel",), "ddpkit.launch.control.commands:CANCEL",
     "stop a run as Ctrl-C or pre-emption would: its nodes checkpoint first (Slurm: the spec's signal, then scancel)"),
    (("report",), "ddpkit.report.command",
     "a run's loss, throughput, per-rank step times and events as one HTML page with PNGs (no network needed)"),
]


def _cmd_render(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if args.doctor:
        spec = doctor_mode(spec)
    check_command(spec.command.module, spec.command.args)
    warn_env(spec, "ddpkit render")
    rendered = render(spec, args.target, template_dir=args.templates)
    note = spec.watchdog.script_note(spec.command, spec.preamble.progress)
    if note:
        print(f"ddpkit render: {note}", file=sys.stderr)
    written: list[Path] = []
    if args.output is None:
        for name, text in rendered.files.items():
            if len(rendered.files) > 1:
                sys.stdout.write(f"# ---- {name} ----\n")
            sys.stdout.write(text)
    else:
        written = rendered.write(args.output)
        for path in written:
            print(f"wrote {path}")
    _print_notes(rendered, args.target, named=args.output is not None or len(rendered.files) > 1)
    target = recorded_target(args.target)
    if target is not None and not args.doctor:
        # kubectl or docker compose starts it; `ddpkit status/logs` ask them (docs/guides/runs.md)
        recorded = record_render(spec, target, rendered, written)
        if recorded is not None and written:
            print(f"ddpkit render: run {recorded.id}: once it is started, `ddpkit status {recorded.id}` and "
                  f"`ddpkit logs {recorded.id}` follow it", file=sys.stderr)
    return 0


def _print_notes(rendered: Rendered, target: str, *, named: bool) -> None:
    """Each file's notes on stderr, named by the file only where there is one
    (rendering one file to stdout writes no file name)."""
    for name, notes in rendered.notes.items():
        for note in notes:
            first = note if note.startswith("warning:") else f"{target}: {name + ': ' if named else ''}{note}"
            print(first, file=sys.stderr)


def _cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(JobSpec.model_json_schema(), indent=2, sort_keys=True))
    return 0


def _add_builtin(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("render", help="render a launch target from a job spec")
    p.add_argument("target", choices=list(TARGETS))
    add_spec_arguments(p)
    p.add_argument("-o", "--output", type=Path, help="write files into this folder instead of stdout")
    p.add_argument("--doctor", action="store_true", help="run `ddpkit doctor` instead of the job's command")
    p.add_argument("--templates", type=Path, help="folder with your own copy of the templates")
    p.set_defaults(handler=_cmd_render, command_parser=p)
    p = sub.add_parser("schema", help="print the JSON Schema of the job spec")
    p.set_defaults(handler=_cmd_schema, command_parser=p)


def _command(name: str) -> Any:
    """The module, or for "module:NAME" its NAME: something with add_arguments and run."""
    module_name, _, attr = name.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _lazy_handler(module_name: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        return int(_command(module_name).run(args) or 0)

    return handler


def _add_module_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for words, module_name, help_text in COMMANDS:
        parent = sub
        for word in words[:-1]:
            if word not in groups:
                group = sub.add_parser(word, help=f"{word} a job")
                groups[word] = group.add_subparsers(dest=f"{word}_how", required=True, metavar="HOW")
            parent = groups[word]
        p = parent.add_parser(words[-1], help=help_text, description=help_text)
        _command(module_name).add_arguments(p)
        p.set_defaults(handler=_lazy_handler(module_name), command_parser=p)


DESCRIPTION = """\
One PyTorch DDP job, described once in a YAML spec, run anywhere you train:
render it for Slurm, Kubernetes, SSH hosts or docker compose, or launch and
supervise it here (local, docker, ssh); `ddpkit train` is the entrypoint the
job runs. Start with `ddpkit render slurm -f job.yaml` or `make demo`."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddpkit")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "unknown (not installed)"


RUN_COMMANDS = ("status", "logs", "cancel", "report")


def _detached_elsewhere(args: argparse.Namespace) -> StoredRun | None:
    """The run a run command names, when it lives on another host (launch ssh
    --detach); None otherwise (the command runs here, and says itself why a
    RUN it cannot find)."""
    from .runs import UnknownRun, resolve

    if args.command not in RUN_COMMANDS or not getattr(args, "run", None):
        return None
    try:
        run = resolve(args.run)
    except (UnknownRun, OSError, ValueError):
        return None
    return run if run.record.remote is not None else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpkit", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ddpkit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_builtin(sub)
    _add_module_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    # The command's own parser, for its one-line error only: handlers get plain
    # values (doctor --spawn pickles them for its children).
    own = vars(args).pop("command_parser", parser)
    if extras:
        print(unknown_options_line(own, extras), file=sys.stderr)  # not the top-level usage
        return ExitCode.BAD_INPUT
    try:
        handler: Callable[[argparse.Namespace], int] = args.handler  # every command parser sets one (set_defaults)
        elsewhere = _detached_elsewhere(args)
        if elsewhere is not None:
            from .launch.ssh.remote import forwarded  # paramiko: only for such a run

            code = forwarded(args, elsewhere)  # a run detached onto another host: asked there
            if code is not None:
                return code
        return handler(args)
    except (TrainArgsError, TemplatesError, SpecError) as exc:
        return exit_on("ddpkit", exc)
    except RenderError as exc:
        return exit_on("ddpkit: internal template error", exc)
    except RunsDirError as exc:  # this host cannot keep the run's record: nothing was started
        return exit_on("ddpkit", exc, ExitCode.PREFLIGHT)


if __name__ == "__main__":
    sys.exit(main())
