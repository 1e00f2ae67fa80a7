"""Host-key checking as OpenSSH does it, from the user's ssh_config.

`StrictHostKeyChecking` decides what happens to a key that is not known
(and to one that changed), `UserKnownHostsFile` which files hold the known
keys: all of them are read, new keys go to the first, and `/dev/null` (or
`none`) means nothing is known and nothing is kept. The command-line flags
win over the config: --known-hosts replaces the file list, and
--accept-new-host-keys raises `yes` to `accept-new` (never lowers `no`).
`ask`, OpenSSH's default, cannot ask anyone here: it refuses, as `yes`.

A refusal names a fix that works for that configuration; it never tells the
user to append a key to /dev/null.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
NOWHERE = ("/dev/null", "none")  # UserKnownHostsFile values that keep nothing


class Checking(Enum):
    """StrictHostKeyChecking, as this launcher can honour it."""

    YES = "yes"  # unknown or changed: refuse (also `ask`: nobody can answer)
    ACCEPT_NEW = "accept-new"  # unknown: record and connect; changed: refuse
    NO = "no"  # unknown: record and connect; changed: connect; both with a warning

    @classmethod
    def parse(cls, value: str | None) -> Checking:
        text = (value or "ask").strip().lower()
        if text in ("no", "off"):
            return cls.NO
        if text == "accept-new":
            return cls.ACCEPT_NEW
        return cls.YES  # yes, ask, and anything OpenSSH would refuse to guess about


class KeyState(Enum):
    KNOWN = "known"  # the host's key is in a known-hosts file
    UNKNOWN = "unknown"  # no key for the host
    CHANGED = "changed"  # a different key is recorded for the host


class Action(Enum):
    CONNECT = "connect"
    RECORD = "record and connect"
    WARN = "connect with a warning"  # StrictHostKeyChecking no
    REFUSE = "refuse"


@dataclass(frozen=True)
class HostKeyPolicy:
    checking: Checking
    files: tuple[Path, ...]  # known-hosts files to read; empty: /dev/null or none

    @property
    def record_to(self) -> Path | None:
        """Where a new key is written: the first file, as OpenSSH does."""
        return self.files[0] if self.files else None

    def action(self, state: KeyState) -> Action:
        """What to do with a host whose key is in `state`."""
        if state is KeyState.KNOWN:
            return Action.CONNECT
        if self.checking is Checking.NO:
            return Action.WARN
        if state is KeyState.UNKNOWN and self.checking is Checking.ACCEPT_NEW:
            return Action.RECORD if self.record_to is not None else Action.CONNECT
        return Action.REFUSE


def policy_from(options: Mapping[str, Any], *, known_hosts: Path | None = None,
                accept_new: bool = False) -> HostKeyPolicy:
    """The policy for one host from its ssh_config options (a paramiko
    SSHConfig lookup) and the launcher's flags."""
    checking = Checking.parse(options.get("stricthostkeychecking"))
    if accept_new and checking is Checking.YES:
        checking = Checking.ACCEPT_NEW
    if known_hosts is not None:
        words = [str(known_hosts)]
    else:
        configured = options.get("userknownhostsfile")
        words = shlex.split(configured) if configured else [str(DEFAULT_KNOWN_HOSTS)]
    if any(w.lower() in NOWHERE for w in words):
        return HostKeyPolicy(checking, ())
    return HostKeyPolicy(checking, tuple(Path(w).expanduser() for w in words))


def unknown_fix(policy: HostKeyPolicy, host: str, port: int) -> str:
    """The one fix for a refused unknown key that can work under `policy`."""
    scan = f"ssh-keyscan -p {port} {shlex.quote(host)}"
    if policy.record_to is None:
        return (f"UserKnownHostsFile is /dev/null, so no key can be recorded: check the key ({scan}), then set "
                "StrictHostKeyChecking accept-new with a real UserKnownHostsFile, or pass --known-hosts FILE "
                "with the key in it")
    return f"check it, then run: {scan} >> {shlex.quote(str(policy.record_to))}   (or pass --accept-new-host-keys)"


def changed_fix(policy: HostKeyPolicy, host: str) -> str:
    # Only the files that exist: ssh-keygen -R fails on a missing one.
    files = [f for f in policy.files if f.is_file()] or list(policy.files) or [DEFAULT_KNOWN_HOSTS]
    removes = "; ".join(f"ssh-keygen -f {shlex.quote(str(f))} -R {shlex.quote(host)}" for f in files)
    return f"if the host was reinstalled, run: {removes}  and add the new key"
