"""The values of a job's `secrets:`, read from the environment of whoever
launches or submits it, and refused with one line when one is unset: a job
that starts without its key fails later, on every rank, far from the cause."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..rendezvous import runkey
from ..spec import JobSpec
from ..spec.yamlfile import SpecFileError


def unset_line(names: list[str], who: str) -> str:
    return (f"{who}: secrets {names} not set in this environment; export them first (the values are read "
            "from here and written into no file)")


def secret_values(spec: JobSpec, who: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: value} for every secret, in the spec's order; SpecFileError
    (exit 2, one line) naming every unset one."""
    env = os.environ if environ is None else environ
    missing = [n for n in spec.secret_names if n not in env]
    if missing:
        raise SpecFileError(unset_line(missing, who))
    return {n: env[n] for n in spec.secret_names}


def with_run_key(values: Mapping[str, str]) -> dict[str, str]:
    """The secrets' values and, last, a fresh run key (runkey.py): it travels
    to the nodes as they do, and like them is in no file or command line."""
    return {**values, runkey.ENV: runkey.new_key()}


def stdin_payload(values: Mapping[str, str]) -> bytes:
    """The values as the SSH node script reads them from its stdin (`read -d ''`):
    each NUL-terminated, in order. No environment value can hold a NUL, and
    os.fsencode gives back the exact bytes the environment held."""
    return b"".join(os.fsencode(v) + b"\0" for v in values.values())
