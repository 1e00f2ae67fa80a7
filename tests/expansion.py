"""What the consumers of our YAML do to `$` before a process sees a value.

kubelet_expand is a line-for-line port of Kubernetes'
third_party/forked/golang/expansion/expand.go (Expand, tryReadVariableName,
MappingFuncFor), which the kubelet applies to a container's command, args
and env values. It works on bytes, as Go strings do.

compose_interpolate follows the Compose specification's interpolation:
`$$` is a literal `$`, `$NAME` / `${NAME}` (and `${NAME:-default}` forms)
substitute, and any other `$` is an "invalid interpolation format" error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

OPERATOR = ord("$")
OPENER = ord("(")
CLOSER = ord(")")


def _try_read_variable_name(data: bytes) -> tuple[bytes, bool, int]:
    """(bytes read, is it a variable name, bytes consumed); `data` starts
    just after a '$'."""
    first = data[0]
    if first == OPERATOR:  # "$$": escaped operator
        return data[0:1], False, 1
    if first == OPENER:
        for i in range(1, len(data)):
            if data[i] == CLOSER:
                return data[1:i], True, i + 1
        return b"$(", False, 1  # incomplete reference: kept as is
    return b"$" + data[0:1], False, 1  # a '$' that starts nothing


def kubelet_expand(text: str, *contexts: Mapping[str, str]) -> str:
    """Expand `$(VAR)` from the first context holding VAR; an unknown
    reference stays `$(VAR)`; `$$` becomes `$`."""
    data = text.encode("utf-8")
    out = bytearray()
    checkpoint = 0
    cursor = 0
    while cursor < len(data):
        if data[cursor] == OPERATOR and cursor + 1 < len(data):
            out += data[checkpoint:cursor]
            read, is_var, advance = _try_read_variable_name(data[cursor + 1 :])
            if is_var:
                name = read.decode("utf-8")
                value = next((ctx[name] for ctx in contexts if name in ctx), None)
                out += (f"$({name})" if value is None else value).encode("utf-8")
            else:
                out += read
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return (bytes(out) + data[checkpoint:]).decode("utf-8")


_LABEL_FIELD = re.compile(r"^metadata\.labels\['([^']+)'\]$")


def kubelet_container_env(env_items: list[dict[str, Any]], injected: Mapping[str, str],
                          secrets: Mapping[str, Mapping[str, str]] | None = None,
                          labels: Mapping[str, str] | None = None) -> dict[str, str]:
    """A container's final environment: each value is expanded against the
    variables defined before it (the kubelet's makeEnvironmentVariables);
    a valueFrom.secretKeyRef item takes the Secret's data as it is (the
    kubelet expands no $(VAR) there), and a missing Secret or key stops the
    container (KeyError; the kubelet's CreateContainerConfigError);
    a valueFrom.fieldRef to one of the pod's labels takes the label's value
    (empty when the pod has no such label); the controller's injected values
    are appended after the template's."""
    resolved: dict[str, str] = {}
    for item in env_items:
        if "valueFrom" in item and "fieldRef" in item["valueFrom"]:
            match = _LABEL_FIELD.match(item["valueFrom"]["fieldRef"]["fieldPath"])
            assert match, f"no label field: {item}"
            resolved[item["name"]] = (labels or {}).get(match.group(1), "")
        elif "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            resolved[item["name"]] = (secrets or {})[ref["name"]][ref["key"]]
        else:
            resolved[item["name"]] = kubelet_expand(item["value"], resolved)
    for name, value in injected.items():
        resolved[name] = value
    return resolved


class InterpolationError(ValueError):
    pass


_COMPOSE_VAR = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def compose_interpolate(text: str, environ: Mapping[str, str]) -> str:
    out = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$":
            out.append(ch)
            i += 1
            continue
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        m = _COMPOSE_VAR.match(text, i)
        if not m:
            raise InterpolationError(f"invalid interpolation format in {text!r} at {i}")
        name = m.group("named") or re.split(r"[:?+-]", m.group("braced"), maxsplit=1)[0]
        out.append(environ.get(name, ""))
        i = m.end()
    return "".join(out)
