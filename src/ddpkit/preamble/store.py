"""The process group's own store, under the run key's control prefix: where
the preamble's parts meet (the rank report, the step-time windows) without
touching the program's collectives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rendezvous import runkey


def group_store(part: str, env: Mapping[str, str] | None = None) -> Any:
    """A PrefixStore over the default process group's store for `part`, or
    None when this torch keeps that store where ddpkit cannot reach it. No
    round number in the prefix: torchrun's restart count is each agent's own
    (a node started again counts from 0 while the others count on), and every
    round of an elastic ddpkit job meets in a store of its own
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE)."""
    import torch.distributed as dist

    try:
        base = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return dist.PrefixStore(f"{runkey.control_prefix(env)}{part}/", base)
