"""The run key: a random secret each run of a job holds, and the store
namespaces derived from it.

torch's TCPStore answers any client that reaches its port, with no
authentication: whoever knows a key's name can read, write or wait on it.
ddpkit's own control records (the watchdog's verdict and acknowledgements,
heartbeats, straggler and node-loss records, the pre-join check-in, the
rendezvous rule's leaving record) therefore live under a prefix that only
a holder of the run key can name: an HMAC of the key, so that even a client
that reads the prefix off the wire cannot turn it back into the key, and
keys under any other prefix (the old public one included) are never read.

Who makes the key, and how it reaches every process (docs/guides/security.md,
"Threat model"): `launch local`, `launch docker` and `launch ssh` make it
with `secrets.token_hex` and hand it over the environment, the Docker API,
or ssh's stdin, as `secrets:` values travel; the rendered Slurm batch script
reads it from /dev/urandom at run time and exports it to the step; a
rendered launch.sh does the same in its own shell. A process without it
(a manual torchrun, a compose file started without one) runs unkeyed, and
says so once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from ..shared import envnames

ENV = envnames.DDPKIT_RUN_KEY
KEY_BYTES = 32  # 256 bits; a key nobody can guess needs at least 128
# The prefix of a process without a key: one fixed, public prefix, so any
# client of the store can read and write its records (UNKEYED_NOTE says so).
UNKEYED_PREFIX = "ddpkit-watchdog/"
_NAMESPACE_HEX = 32  # 128 bits of the HMAC: not guessable, short enough for every store key
UNKEYED_NOTE = (f"ddpkit: {ENV} is not set: ddpkit's control records in the rendezvous store (the watchdog's "
                "verdict, heartbeats, straggler and node-loss records) are under a public prefix, and any client "
                "that reaches the master port can forge a stall or a node loss (docs/guides/security.md, threat model); "
                "ddpkit's launchers and rendered scripts set it")


def new_key() -> str:
    """A fresh run key: 64 hex digits from the OS's CSPRNG."""
    return secrets.token_hex(KEY_BYTES)


def _derive(key: str, purpose: str) -> str:
    return hmac.new(key.encode(), purpose.encode(), hashlib.sha256).hexdigest()[:_NAMESPACE_HEX]


def key_from(env: Mapping[str, str] | None = None) -> str | None:
    """This process's run key (None: unset or empty)."""
    value = (os.environ if env is None else env).get(ENV, "")
    return value or None


def control_prefix(env: Mapping[str, str] | None = None) -> str:
    """The store prefix of ddpkit's control records for this run."""
    key = key_from(env)
    return UNKEYED_PREFIX if key is None else f"ddpkit-{_derive(key, 'control')}/"


def group_prefix(env: Mapping[str, str] | None = None) -> str | None:
    """The store prefix of the process group's own keys where ddpkit hands
    init_process_group the store (train/startup/netcheck.py): the addresses and
    counters the group exchanges at start-up, out of a stranger's reach.
    None without a key: the group's keys stay where torch puts them."""
    key = key_from(env)
    return None if key is None else f"ddpkit-{_derive(key, 'group')}"


def rdzv_run_id(run_id: str, env: Mapping[str, str] | None = None) -> str:
    """The rendezvous id agents meet under: the rendered (public) id with a
    tag only holders of the run key compute, so that torch's rendezvous
    state in the store cannot be named, read or overwritten by anyone who
    read the rendered files. Without a key, the rendered id itself."""
    key = key_from(env)
    return run_id if key is None else f"{run_id}-{_derive(key, 'rdzv:' + run_id)}"
