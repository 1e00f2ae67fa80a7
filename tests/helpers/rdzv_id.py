"""The rendezvous id a node's agents meet under, found as the node finds it:
ddpkit's agent parses torchrun's arguments from the node's launch line,
torchrun builds its configuration and then the handler through its registry
(tests/test_elastic_render.py, tests/test_runkey.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.registry import _register_out_of_tree_handlers
from torch.distributed.run import config_from_args

from ddpkit.agent import __main__ as agent_main
from ddpkit.contract import RowKey, sources, torchrun_argv
from ddpkit.launch.local import build_nodes, free_port
from ddpkit.rendezvous import runkey
from ddpkit.spec import JobSpec
from ddpkit.targets import render
from ddpkit.targets.sshnode import RDZV_ID
from tests.emulators import controller_env

# The targets whose nodes hold a run key (docs/guides/security.md, threat model), and the CLI target that renders each.
KEYED = {RowKey.SLURM: "slurm", RowKey.SSH: "ssh", RowKey.COMPOSE: "compose", RowKey.LOCAL: None}
CANARY = "5e1f" * 16  # a run key, as the nodes of a keyed target hold one


def as_run(spec: JobSpec, target: RowKey, tmp_path: Path) -> tuple[list[str], str, str]:
    """Node 1's launch line as it runs, its run key, and everything a stranger
    may read about the job: the rendered files and the launch lines (launch
    local renders no file; its agents' command lines are what `ps` shows)."""
    if target is RowKey.LOCAL:
        nodes = build_nodes(spec, tmp_path)
        return nodes[1].argv, nodes[1].env[runkey.ENV], "\n".join(" ".join(n.argv) for n in nodes)
    files = render(spec, str(KEYED[target])).files
    env = controller_env(spec, target, 1, job_id=4242) | {RDZV_ID: "el-run1", "DDPKIT_MASTER_ADDR": "h1"}
    argv = [a.resolve(env) for a in torchrun_argv(spec, sources(spec, target))]
    return argv, CANARY, "\n".join([*files.values(), " ".join(argv)])


def meets_under(monkeypatch: pytest.MonkeyPatch, argv: list[str], key: str) -> tuple[str, str]:
    """The rendezvous backend and the id the handler built from `argv` (a
    launch line running ddpkit's agent) uses on a node holding `key`; node 0's
    store, where the handler needs one, is a fresh one here."""
    assert argv[1:3] == ["-m", "ddpkit.agent"], argv
    monkeypatch.setenv(runkey.ENV, key)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's configuration would set it in this process
    args = agent_main.parse_args(argv[3:])
    if args.rdzv_backend == "static":
        args.master_addr, args.master_port = "127.0.0.1", free_port()
    else:
        args.rdzv_endpoint = f"127.0.0.1:{free_port()}"
    config, _, _ = config_from_args(args)
    _register_out_of_tree_handlers()
    params = RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id, config.min_nodes,
                                  config.max_nodes, local_addr="127.0.0.1", **{**config.rdzv_configs, "is_host": True})
    torch_delay = dyn._delay  # ddpkit's handler sets its poll module-wide
    try:
        return config.rdzv_backend, rendezvous_handler_registry.create_handler(params).get_run_id()
    finally:
        dyn._delay = torch_delay
