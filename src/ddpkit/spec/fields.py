"""The base of every section and the field types the sections share.

A field type is `Annotated[str, AfterValidator(rule)]`: the rule and its
one-line refusal are written once and the field names its meaning
(`SlurmTime`, `K8sQuantity`, `K8sNamespace`), instead of one validator
method per field. Every refusal is `'<value>' <what is wrong and the fix>`;
specfile adds the field's path and the value pydantic saw.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IFNAME = re.compile(r"^[A-Za-z0-9_.@:-]{1,15}$")
# Slurm directive values are parsed by sbatch, not by a shell: keep them to
# characters that cannot start another option or another directive.
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,+-]+$")
SLURM_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+$")
SLURM_MEM = re.compile(r"^\d+[KMGT]?$")
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P|E|Ei)?$")
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
DNS_LABEL_MAX = 63  # Kubernetes' limit on a label (and a DNS-1035 name)


class Strict(BaseModel):
    """Base for every section: unknown keys are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=True)


Rule = Callable[[str], str]


def rule(ok: Callable[[str], bool], problem: str) -> Rule:
    """A check that returns the text `ok` accepts and refuses any other with
    `problem`, a format string over `value` (e.g. "{value!r} is not ...")."""

    def check(value: str) -> str:
        if not ok(value):
            raise ValueError(problem.format(value=value))
        return value

    return check


def matching(pattern: re.Pattern[str], problem: str, *, max_len: int | None = None) -> Rule:
    """`rule` for a text that `pattern` matches (and no longer than `max_len`)."""
    return rule(lambda v: (max_len is None or len(v) <= max_len) and bool(pattern.match(v)), problem)


def each(check: Rule) -> Callable[[list[str]], list[str]]:
    """`check` on every item of a list, reported on the list as a whole (the
    refusal names the field, not an index, and shows the list)."""

    def check_all(values: list[str]) -> list[str]:
        for v in values:
            check(v)
        return values

    return check_all


def no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL byte, which no shell, YAML file or environment can carry; remove it")
    return value


def _int_as_text(value: Any) -> Any:
    # YAML reads `mem: 0` (Slurm: all of the node's memory) and `mem: 64000` (MB) as numbers
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# ---- Slurm: values sbatch reads on an #SBATCH line ---------------------------------

SlurmWord = Annotated[str, AfterValidator(matching(SLURM_WORD, "{value!r} may only hold letters, digits and _ . , + -"))]
SlurmTime = Annotated[str, AfterValidator(matching(
    SLURM_TIME, "{value!r} is not a Slurm time: use MM, HH:MM:SS or D-HH:MM:SS"))]
SlurmMem = Annotated[str, BeforeValidator(_int_as_text), AfterValidator(matching(
    SLURM_MEM, "{value!r} is not a Slurm memory size: use e.g. 64G or 500M"))]

# ---- Kubernetes names and quantities -------------------------------------------------

K8sQuantity = Annotated[str, AfterValidator(matching(
    K8S_QUANTITY, "{value!r} is not a Kubernetes quantity, e.g. 8Gi, 500m, 16"))]
# A size (memory, storage): the same syntax, a size for the example.
K8sSize = Annotated[str, AfterValidator(matching(K8S_QUANTITY, "{value!r} is not a Kubernetes quantity, e.g. 8Gi"))]
_SUFFIX: dict[str, int | Decimal] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "m": Decimal("1e-3"), "": 1,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_value(text: str) -> Decimal:
    """A Kubernetes quantity's value (`8Gi` -> 8589934592), to compare two
    sizes; `text` has passed K8sQuantity (K8S_QUANTITY's suffixes)."""
    number = text.rstrip("KMGTPEikm")
    suffix = text[len(number):]
    return Decimal(number) * Decimal(_SUFFIX[suffix])


K8sNamespace = Annotated[str, AfterValidator(matching(
    DNS1123_LABEL, "{value!r} is not a Kubernetes namespace (DNS-1123 label)", max_len=DNS_LABEL_MAX))]
K8sObjectName = Annotated[str, AfterValidator(matching(
    DNS1123_SUBDOMAIN, "{value!r} is not a Kubernetes object name (DNS-1123 subdomain)"))]
# The job's name: every target derives host, pod and service names from it.
JobName = Annotated[str, AfterValidator(matching(
    DNS1035,
    "{value!r} is not a DNS-1035 label: use lower-case letters, digits and '-', "
    "start with a letter, end with a letter or digit, at most 63 characters",
    max_len=DNS_LABEL_MAX))]

# ---- What a node runs ----------------------------------------------------------------

PythonModule = Annotated[str, AfterValidator(matching(
    MODULE_NAME, "{value!r} is not a dotted python module name, e.g. mypkg.train"))]
# A path as the nodes see it, passed as one argv word.
NodePath = Annotated[str, AfterValidator(no_nul), AfterValidator(rule(
    lambda v: bool(v) and not v.startswith("-") and "\n" not in v,
    "{value!r} must be a path: not empty, no leading '-', no newline"))]
ImageRef = Annotated[str, AfterValidator(rule(
    lambda v: bool(v) and not any(c.isspace() for c in v) and not v.startswith("-") and v.isascii(),
    "{value!r} is not an image reference like registry/repo:tag"))]
Argv = Annotated[list[str], AfterValidator(each(no_nul))]


# ---- bind mounts: SRC:DST[:ro|rw], both absolute ------------------------------------


def _mount(m: str) -> str:
    parts = m.split(":")
    if len(parts) not in (2, 3) or not all(parts[:2]) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise ValueError(f"{m!r}: write mounts as SRC:DST or SRC:DST:ro")
    if "," in m or "\n" in m:
        raise ValueError(f"{m!r}: commas and newlines cannot appear in a mount (pyxis splits on commas)")
    relative = [p for p in parts[:2] if not p.startswith("/")]
    if relative:
        # A relative source resolves against wherever the task starts
        # (differently per runtime); a relative target is refused by both.
        raise ValueError(f"{m!r}: {relative[0]!r} is not an absolute path; write both sides of a mount "
                         f"as absolute paths, e.g. /scratch/data:/data")
    return m


Mounts = Annotated[list[str], AfterValidator(each(_mount))]


@dataclass(frozen=True)
class MountParts:
    """One 'SRC:DST[:ro|rw]' mount, read."""

    source: str
    target: str
    read_only: bool

    @classmethod
    def of(cls, text: str) -> MountParts:
        source, target, *mode = text.split(":")
        return cls(source, target, mode == ["ro"])
