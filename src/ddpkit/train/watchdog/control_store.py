"""The store the watchdog keeps its records in: a client of its own (never
a collective: those are what is stuck), under the run's control prefix, and
in an elastic job on the rendezvous store under a token of the round."""

from __future__ import annotations

import datetime
import os
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ...rendezvous import runkey
from ...shared import envnames

if TYPE_CHECKING:
    import torch.distributed as dist

ROUND_KEY = "round"  # in the process group's store: the token the round's records go under (open_store)


def open_store(master_addr: str | None, master_port: int | None, rank: int = 0, timeout_s: float = 60.0,
               env: Mapping[str, str] = os.environ) -> dist.Store:
    """A client of its own to the store the watchdog keeps its records in,
    under the run's control prefix (runkey.py): a client without the run
    key writes where no rank reads.

    That store is the process group's (MASTER_ADDR; without an address the
    group's own, e.g. --spawn's file store), except in an elastic job, whose
    agent names its rendezvous store (DDPKIT_CONTROL_STORE): the group's
    store lives in rank 0's process, which a frozen node 0 freezes with it,
    and then no rank could publish or judge; the rendezvous store is the
    launcher's under `launch local` and `launch ssh`, and outlives any node.
    It outlives the rounds too, so each round's records go under a token of
    the round, which rank 0 hands the others through the group's store (a
    new one every round: TORCH_DISABLE_SHARE_RDZV_TCP_STORE)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = runkey.control_prefix(env)
    base: dist.Store
    if not (master_addr and master_port):
        return dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    base = dist.TCPStore(master_addr, int(master_port), is_master=False, timeout=timeout, wait_for_workers=False)
    control = env.get(envnames.DDPKIT_CONTROL_STORE)
    if not control or env.get(envnames.TORCH_DISABLE_SHARE_RDZV_TCP_STORE) != "1":
        return dist.PrefixStore(prefix, base)
    round_token = _round_token(dist.PrefixStore(prefix, base), rank)
    host, _, port = control.rpartition(":")
    elsewhere = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"{prefix}round-{round_token}/", elsewhere)


def _round_token(group_store: dist.Store, rank: int) -> str:
    """The round's token: rank 0 draws it once per round (the round's group
    store is new); a second watchdog of the same round (ddpkit train's, taking
    over from the one a program's start-up started) gets the same one, or the
    ranks' records would go under different tokens and never meet."""
    if rank == 0:
        return bytes(group_store.compare_set(ROUND_KEY, "", secrets.token_hex(8))).decode()
    return bytes(group_store.get(ROUND_KEY)).decode()  # the others wait for rank 0's (the store's timeout)
