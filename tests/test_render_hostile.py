"""Hostile values come out exactly as given and are never executed.

Property-based: env values and command arguments full of quotes, `$(...)`,
backticks, newlines, U+2028, emoji and leading dashes go through every
target. YAML outputs are parsed and each value is passed through what its
consumer does to `$` (tests/expansion.py) before comparing byte for byte.
Shell outputs follow one convention, whatever the target: the job's
environment is exported with `export NAME=<quoted value>` statements, each
starting a line. Those statements alone are sourced by a bash with an empty
environment and no PATH, and the values are read back byte for byte.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ddpkit.contract import job_env, sources, torchrun_argv
from ddpkit.render.engine import Rendered
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import SpecError, load_spec
from ddpkit.targets import TARGETS, TargetRenderer, compose, kubernetes, render
from tests.emulators import controller_env
from tests.expansion import compose_interpolate, kubelet_container_env, kubelet_expand

FRAGMENTS = [
    "'", '"', "\\", "$(id)", "`id`", "$$", "$", "$(", ")", "(", "${HOME}", "$HOME", "$(MASTER_ADDR)",
    "\n", "\r\n", "\t", " ", "\u2028", "\u2029", "\x85", "\ufeff", "😀", "é", "-", "--rm", "-rf /",
    "#", ";", "&&", "|", ">", "*", "~", "!", "{{ x }}", "{% raw %}", ": ", "- ", "? ", "&a", "!!str",
    "%x", "\\n", "'\"'\"'", "null", "true", "0x1F", "",
]
hostile = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(codec="utf-8", exclude_characters="\x00"),
                                                       max_size=4)),
    max_size=8,
).map("".join)
hostile_env = st.lists(hostile, min_size=1, max_size=4).map(
    lambda values: {f"HOSTILE_{i}": v for i, v in enumerate(values)})
hostile_args = st.lists(hostile, max_size=4)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def spec_with(env: dict[str, str], args: list[str], **fields: Any) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "hostile", "nodes": 2, "nproc_per_node": 2, "env": env, "command": {"args": args}, **fields})


# ---- Kubernetes: the kubelet's $(VAR) / $$ expansion ----


def k8s_containers(kind: str, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if kind == "pytorchjob":
        specs = docs[0]["spec"]["pytorchReplicaSpecs"]
        return [specs["Master"]["template"]["spec"]["containers"][0],
                specs["Worker"]["template"]["spec"]["containers"][0]]
    if kind == "indexed-job":
        c = docs[1]["spec"]["template"]["spec"]["containers"][0]
        return [c, c]
    if kind == "jobset":
        c = docs[0]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
        return [c, c]
    t = docs[0]["spec"]["trainer"]
    return [t, t]


@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job", "trainjob", "jobset"])
@SETTINGS
@given(env=hostile_env, args=hostile_args)
def test_k8s_values_survive_the_kubelet(kind: str, env: dict[str, str], args: list[str]) -> None:
    spec = spec_with(env, args, k8s={"kind": kind})
    target = kubernetes.KIND_TARGET[kind]
    text = render(spec, "k8s").files[kubernetes.filename(spec)]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    argv = torchrun_argv(spec, sources(spec, target))
    for i, c in enumerate(k8s_containers(kind, docs)):
        injected = controller_env(spec, target, i)
        final_env = kubelet_container_env(c["env"], injected)
        for name, value in env.items():
            assert final_env[name] == value
        started = [kubelet_expand(a, final_env) for a in c["command"]]
        assert started == [a.resolve(injected) for a in argv]
        assert started[len(started) - len(args):] == args


# ---- compose: $$ interpolation ----


@SETTINGS
@given(env=hostile_env, args=hostile_args)
def test_compose_values_survive_interpolation(env: dict[str, str], args: list[str]) -> None:
    spec = spec_with(env, args)
    doc = yaml.safe_load(render(spec, "compose").files[compose.FILENAME])
    # A host environment full of the names we use must change nothing.
    host_env = {"HOME": "/root/PWNED", "MASTER_ADDR": "PWNED", "id": "PWNED"}
    for svc in compose.services(spec):
        got = doc["services"][svc.name]
        command = [compose_interpolate(a, host_env) for a in got["command"]]
        # `NAME: null` (the run key, secrets) is filled from the shell by compose: no value to interpolate
        environment = {k: compose_interpolate(v, host_env) for k, v in got["environment"].items() if v is not None}
        assert command == svc.command and command[len(command) - len(args):] == args
        assert {k: environment[k] for k in env} == env


# ---- every shell target: `export NAME=...` read back by bash ----


def shell_targets() -> list[str]:
    probe = JobSpec(name="probe")
    return sorted(name for name, module in TARGETS.items()
                  if any(out.kind == "shell" for out in module.build(probe)))


def export_statement(script: str, name: str) -> str:
    """The `export NAME=...` statement, however many lines its quoted value
    spans: lines are added until the statement is complete shell words."""
    # Bash ends a line at "\n" only (str.splitlines would also split at U+2028, \x85, \r ...).
    lines = [line + "\n" for line in script.split("\n")]
    starts = [i for i, line in enumerate(lines) if line.startswith(f"export {name}=")]
    assert len(starts) == 1, f"expected one line starting `export {name}=`, found {len(starts)}"
    for end in range(starts[0] + 1, len(lines) + 1):
        snippet = "".join(lines[starts[0]:end])
        try:
            words = shlex.split(snippet)
        except ValueError:  # an open quote: the value goes on
            continue
        assert len(words) == 2 and words[0] == "export", f"not a plain export: {snippet!r}"
        return snippet
    raise AssertionError(f"export {name} never closes its quotes")


def bash_read_back(statements: list[str], names: list[str], tmp: Path) -> dict[str, str]:
    exports = tmp / "exports.sh"
    exports.write_bytes("".join(s if s.endswith("\n") else s + "\n" for s in statements).encode("utf-8"))
    reader = 'source "$1"; shift; for n in "$@"; do printf "%s\\0" "${!n}"; done'
    # Empty environment, no PATH: even a broken export could not start a program.
    result = subprocess.run(["/bin/bash", "--noprofile", "--norc", "-c", reader, "_", str(exports), *names],
                            env={"PATH": "/nonexistent"}, capture_output=True, check=False)
    assert result.returncode == 0 and not result.stderr, result.stderr.decode("utf-8", "replace")
    values = result.stdout.split(b"\0")[:-1]
    return dict(zip(names, (v.decode("utf-8") for v in values)))


SHELL_TARGETS = shell_targets()
@pytest.mark.skipif(not SHELL_TARGETS, reason="no target renders a shell script yet")
@pytest.mark.parametrize("target", SHELL_TARGETS)
# No shrinking: each example costs a bash run, and the failing input is printed anyway.
@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(env=hostile_env)
def test_shell_exports_read_back_byte_for_byte(target: str, env: dict[str, str], tmp_path: Path) -> None:
    spec = spec_with(env, [])
    module = TARGETS[target]
    rendered = render(spec, target)
    want = job_env(spec)
    for script in node_side_scripts(target, spec, module, rendered):
        statements = [export_statement(script, name) for name in env]
        assert bash_read_back(statements, list(env), tmp_path) == {k: want[k] for k in env}


def node_side_scripts(target: str, spec: JobSpec, module: TargetRenderer, rendered: Rendered) -> list[str]:
    """The scripts whose exports a node runs. The SSH launcher ships its node
    script inside one quoted ssh argument, so read that script itself (it is
    what every host executes, and the test of launch.sh checks it is carried
    byte for byte)."""
    if target == "ssh":
        from ddpkit.targets.sshnode import node_script

        return [node_script(spec)]
    return [rendered.files[out.name] for out in module.build(spec) if out.kind == "shell"]


# ---- names are refused, not escaped ----


@SETTINGS
@given(name=hostile)
def test_hostile_job_names_are_refused_or_plain(name: str) -> None:
    try:
        spec = load_spec(None, overrides=[f"name={name}"])
    except SpecError as exc:
        assert any("name" in p for p in exc.problems)
        return
    assert spec.name == name and name.isascii() and name.replace("-", "").isalnum()
