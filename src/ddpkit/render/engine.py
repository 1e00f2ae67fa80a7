"""Render primitives: one Jinja Environment, its filters, the post-render
checks, and the Rendered / OutputFile types. Which files a target renders
lives in ddpkit.targets (which imports this module, never the reverse).

Rules (docs/ARCHITECTURE.md): StrictUndefined, so a missing variable is an
error; every value reaching a shell goes through `shq` or is a node-side
`FromNode` part; every YAML scalar goes through `tojson`; every escaping
rule is a function of ddpkit.render.quoting. Rendered text is checked before it is
returned: shell with `bash -n`, YAML parsed back.

Convention for shell templates: the job environment is exported as
`export NAME=<shq value>` statements, each starting a line, in the file the
target renders; tests source exactly those statements and read the values
back byte for byte.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import jinja2
import yaml

from ..contract import Arg, FromNode
from ..shared.exitcodes import ExitCode
from ..shared.wording import plural
from . import quoting
from .templatedir import default_template_dir

FileKind = Literal["shell", "yaml", "text"]


@dataclass(frozen=True)
class OutputFile:
    """One file a target produces: which template, with which variables."""

    name: str
    template: str
    variables: dict[str, Any]
    kind: FileKind
    mode: int = 0o644
    # What the user should read before using the file (a warning, the Pod
    # Security level it meets); the CLI prints them, the target does not.
    notes: tuple[str, ...] = ()


@dataclass
class Rendered:
    files: dict[str, str] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    notes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # file name -> its notes

    def write(self, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in self.files.items():
            path = out_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            path.chmod(self.modes.get(name, 0o644))
            written.append(path)
        return written


class RenderError(Exception):
    """A rendered file failed its post-render check: a bug in a template."""

    exit_code = ExitCode.SOFTWARE


class TemplatesError(ValueError):
    """`--templates DIR` cannot serve a template: bad input, one line (exit 2)."""

    exit_code = ExitCode.BAD_INPUT


# Characters PyYAML refuses to read raw, or reads as line breaks even inside
# a quoted scalar. JSON leaves them raw with ensure_ascii=False.
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]")


def yaml_scalar(value: Any) -> str:
    """JSON is YAML: a double-quoted scalar that reads back byte for byte."""
    text = json.dumps(value, ensure_ascii=False)
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def shq(value: Any) -> str:
    return quoting.shell_word(value)


def shell_arg(arg: Arg) -> str:
    """One argv token for bash: literal parts single-quoted, node-side
    variables double-quoted so they expand where the script runs."""
    out = []
    for part in arg.parts:
        out.append(quoting.shell_var(part.var) if isinstance(part, FromNode) else shq(part) if part else "")
    return "".join(out) or "''"


def shell_argv(argv: list[Arg]) -> str:
    return " ".join(shell_arg(a) for a in argv)


def k8s_arg(arg: Arg) -> str:
    """One argv token for a Kubernetes container: `$(VAR)` expands from the
    container's environment; every literal '$' is doubled so that user text
    such as '$(id)' stays literal (Kubernetes turns '$$' into '$')."""
    return "".join(f"$({p.var})" if isinstance(p, FromNode) else quoting.kubelet_literal(p) for p in arg.parts)


@lru_cache(maxsize=8)
def environment(template_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        shq=shq,
        tojson=yaml_scalar,
        shell_arg=shell_arg,
        shell_argv=shell_argv,
        k8s_arg=k8s_arg,
        k8s_literal=quoting.kubelet_literal,
        compose_literal=quoting.compose_literal,
        plural=plural,  # {{ spec.nodes | plural('node') }}: 1 node, 2 nodes
    )
    return env


def template(name: str) -> jinja2.Template:
    """A template of the shipped set, for text that is not a file of its own
    (the SSH node payload)."""
    return environment(default_template_dir()).get_template(name)


def check_shell(name: str, text: str) -> None:
    result = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True, check=False)
    if result.returncode != 0:
        raise RenderError(f"{name}: bash -n failed: {result.stderr.strip()}")


def check_yaml(name: str, text: str) -> None:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError(f"{name}: rendered YAML does not parse: {exc}") from exc
    if not docs:
        raise RenderError(f"{name}: rendered YAML is empty")


def render_files(outputs: list[OutputFile], template_dir: Path | None = None) -> Rendered:
    """Render every output and check it (bash -n, YAML parse) before returning it."""
    if template_dir is not None and not template_dir.is_dir():
        what = "not a folder" if template_dir.exists() else "no such folder"
        raise TemplatesError(f"--templates {template_dir}: {what}; pass a folder holding your copy of the "
                             f"templates (copy {default_template_dir()}), or leave --templates out")
    env = environment(template_dir or default_template_dir())
    rendered = Rendered()
    for out in outputs:
        try:
            text = env.get_template(out.template).render(**out.variables)
        except jinja2.TemplateNotFound as exc:
            if template_dir is None:
                raise  # the package's own templates: an internal error
            name = exc.name if isinstance(exc.name, str) else out.template  # an include names its own
            raise TemplatesError(f"--templates {template_dir}: has no {name}; copy it from "
                                 f"{default_template_dir() / name}, or leave --templates out") from None
        except jinja2.UndefinedError as exc:
            if template_dir is not None:  # a copy made for another version's variables: the user's to refresh
                raise TemplatesError(f"--templates {template_dir}: {out.template}: {exc} (a copy from another "
                                     f"ddpkit version); copy it again from {default_template_dir() / out.template}, "
                                     "or leave --templates out") from None
            raise RenderError(f"{out.template}: {exc}") from exc
        if out.kind == "shell":
            check_shell(out.name, text)
        elif out.kind == "yaml":
            check_yaml(out.name, text)
        rendered.files[out.name] = text
        rendered.modes[out.name] = out.mode
        if out.notes:
            rendered.notes[out.name] = out.notes
    return rendered

