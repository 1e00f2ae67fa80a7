"""Build a JobSpec from a YAML file plus command-line overrides, and turn
pydantic's errors into messages that name the field, the bad value and the fix.
The only reader of job YAML: the spec package validates data, never files."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from ..shared.exitcodes import ExitCode
from . import JobSpec, env_warnings

NOTHING_DONE = "nothing was written or started"


class SpecError(Exception):
    """Invalid job input: str() is a heading and the `problems` as a list,
    what the CLI prints before it exits 2."""

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, problems: list[str]):
        super().__init__(f"invalid job spec ({NOTHING_DONE}):" + "".join(f"\n  - {p}" for p in problems))
        self.problems = problems


class SpecFileError(SpecError):
    """The job spec's file cannot be read at all (or a launcher's own input,
    such as a secret's value, is missing): one problem, one line."""

    def __init__(self, problem: str):
        super().__init__([problem])

    def __str__(self) -> str:
        return f"{self.problems[0]} ({NOTHING_DONE})"


def load_yaml(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of job fields")
    return data


def _folder_hint(path: Path) -> str:
    try:
        yamls = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    except OSError:
        yamls = []
    if yamls:
        return f"pass one of its YAML files ({', '.join(yamls[:3])}{', ...' if len(yamls) > 3 else ''})"
    return "pass the job's YAML file (see examples/)"


@dataclass(frozen=True)
class Override:
    path: tuple[str, ...]
    raw: str

    @classmethod
    def parse(cls, text: str) -> Override:
        key, sep, raw = text.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise SpecError([f"--set {text!r}: write --set key.path=value, e.g. --set slurm.partition=gpu"])
        return cls(tuple(key.split(".")), raw)


def _annotation_at(model: type[BaseModel], path: tuple[str, ...]) -> Any:
    """The type annotation of the field at `path`, or None when it is not a model field."""
    annotation: Any = model
    for part in path:
        annotation = _strip_optional(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            if field is None:
                return None
            annotation = field.annotation
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        elif typing.get_origin(annotation) in (list, tuple) and part.isdigit():
            annotation = typing.get_args(annotation)[0]  # an item of a list of sections (k8s.volumes.0)
        else:
            return None
    return annotation


def _strip_optional(annotation: Any) -> Any:
    """The type under `X | None` and under `Annotated[X, rule]` (the spec's
    field types): a `SlurmTime | None` field is text as much as `str` is."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _is_plain_str(annotation: Any) -> bool:
    return _strip_optional(annotation) is str


def _coerce(override: Override) -> Any:
    """Strings stay byte-exact for str fields (so 'yes' or '0755' is not
    reinterpreted by YAML); everything else is read as a YAML value."""
    if _is_plain_str(_annotation_at(JobSpec, override.path)):
        return override.raw
    try:
        return yaml.safe_load(override.raw) if override.raw != "" else ""
    except yaml.YAMLError:
        return override.raw


def apply_overrides(data: dict[str, Any], overrides: list[Override]) -> dict[str, Any]:
    for override in overrides:
        node = data
        for part in override.path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError([f"--set {'.'.join(override.path)}: {part!r} is not a section"])
            node = child
        node[override.path[-1]] = _coerce(override)
    return data


def _valid_keys(loc: tuple[Any, ...]) -> list[str]:
    annotation = _strip_optional(_annotation_at(JobSpec, tuple(str(p) for p in loc[:-1])))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return sorted(annotation.model_fields)
    return []


def _format(error: ErrorDetails) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    where = ".".join(str(p) for p in loc) or "(job)"
    if error["type"] == "extra_forbidden":
        valid = ", ".join(_valid_keys(loc))
        return f"{where}: unknown field; valid fields here: {valid}"
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return f"{where}: {message}{shown}"


def build_spec(data: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError([_format(e) for e in exc.errors(include_url=False)]) from None


def load_spec(
    path: Path | None,
    *,
    overrides: list[str] = (),  # type: ignore[assignment]
    nodes: int | None = None,
    nproc_per_node: int | None = None,
    image: str | None = None,
    gpus_per_node: int | None = None,
) -> JobSpec:
    """The job as the user described it: file, then flags, then --set;
    `gpus_per_node` (GPUs) becomes processes per node once the spec's
    strategy and devices_per_process are known."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = load_yaml(path)
        except FileNotFoundError:
            raise SpecFileError(f"-f {path}: no such file; pass the path of a job YAML (see examples/)") from None
        except IsADirectoryError:
            raise SpecFileError(f"-f {path}: that is a folder; {_folder_hint(path)}") from None
        except PermissionError as exc:
            raise SpecFileError(f"-f {path}: cannot read it ({exc.strerror}); make it readable, "
                                "or pass a copy you can read") from None
        except UnicodeDecodeError:
            raise SpecFileError(f"-f {path}: not a text file; pass the job's YAML file (see examples/)") from None
        except (yaml.YAMLError, ValueError) as exc:
            raise SpecError([f"-f {path}: not a YAML job mapping: {exc}"]) from None
    for key, value in (("nodes", nodes), ("nproc_per_node", nproc_per_node), ("image", image)):
        if value is not None:
            data[key] = value
    data = apply_overrides(data, [Override.parse(o) for o in overrides])
    if gpus_per_node is not None:
        _set_gpus_per_node(data, gpus_per_node, nproc_given=nproc_per_node is not None)
    return build_spec(data)


def _set_gpus_per_node(data: dict[str, Any], gpus: int, *, nproc_given: bool) -> None:
    """--gpus-per-node G: ddp runs G / devices_per_process processes, dp one process driving G."""
    flag = f"--gpus-per-node {gpus}"
    if nproc_given:
        raise SpecError([f"{flag} and --nproc-per-node both size the node; pass one"])
    if data.get("device", "cuda") != "cuda":
        raise SpecError([f"{flag}: this job runs on device: cpu; pass --nproc-per-node for its processes"])
    if gpus < 1:
        raise SpecError([f"{flag}: pass 1 or more"])
    if data.get("strategy", "ddp") == "dp":
        data["devices_per_process"] = gpus
        return
    per_process = int(data.get("devices_per_process", 1))
    if gpus % per_process:
        raise SpecError([f"{flag} is not a multiple of devices_per_process {per_process}; "
                         f"pass a multiple of {per_process}"])
    data["nproc_per_node"] = gpus // per_process


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """The job-spec flags shared by render, launch and submit."""
    parser.add_argument("-f", "--file", type=Path, help="job spec YAML (see examples/)")
    parser.add_argument("--nodes", type=int, help="override nodes")
    parser.add_argument("--nproc-per-node", dest="nproc_per_node", type=int,
                        help="override nproc_per_node (processes per node)")
    parser.add_argument("--gpus-per-node", dest="gpus_per_node", type=int,
                        help="GPUs per node: nproc_per_node = GPUs / devices_per_process (strategy dp: one "
                             "process driving them all)")
    parser.add_argument("--image", help="override image")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override any field, e.g. --set slurm.partition=gpu (repeatable)")


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    return load_spec(args.file, overrides=args.overrides, nodes=args.nodes,
                     nproc_per_node=args.nproc_per_node, image=args.image, gpus_per_node=args.gpus_per_node)


def warn_env(spec: JobSpec, who: str) -> None:
    """A warning line on stderr for each env: value that looks like a
    credential (spec.secrets.token_like_env), and a note for each old
    spelling the spec used (spec.deprecations): not errors, the job runs."""
    for line in [*spec.deprecations, *env_warnings(spec.env)]:
        print(f"{who}: {line}", file=sys.stderr)


def dump_yaml(spec: JobSpec) -> str:
    """The job as it runs, every default filled in, as YAML that `-f` reads
    back (a run folder's spec.yaml)."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
