"""The checks that span sections of a job spec: elastic membership against
the node count and rendezvous, the device layout against the trainer's own
flags, and the secrets against a Slurm `--export`. Each returns the
problems in words; JobSpec's validators raise them.
"""

from __future__ import annotations

from ..shared.agreed import DEVICES_PER_PROCESS_FLAG, STRATEGY_FLAG, TRAIN_MODULE, flag_value
from .sections import MAX_GPUS_PER_NODE, Command, Elastic, Rendezvous


def export_problem(names: list[str], extra_sbatch: list[str]) -> str | None:
    """A secret reaches a Slurm job through sbatch's export of the submitting
    environment: an --export in extra_sbatch that leaves it out would start
    the job without it."""
    exports = [o.partition("=")[2] for o in extra_sbatch if o.startswith("--export=")]
    if not names or not exports:
        return None
    items = {item.partition("=")[0] for item in exports[-1].split(",")}  # sbatch keeps the last
    missing = [n for n in names if n not in items]
    if "ALL" in items or not missing:
        return None
    kept = [item for item in exports[-1].split(",") if item not in ("NONE", "NIL", "")]  # neither takes names
    return (f"slurm.extra_sbatch --export={exports[-1]} keeps secrets {missing} from the job; "
            f"add them to the list (--export={','.join([*kept, *missing])}) or remove --export")


def elastic_problems(e: Elastic | None, nodes: int, rendezvous: Rendezvous, command: Command) -> list[str]:
    """elastic must leave a node to lose, and it needs c10d rendezvous: an
    explicit `rendezvous.backend: static` is refused rather than overridden."""
    if e is None:
        return []
    out = []
    if nodes < 2:
        out.append("elastic: a 1-node job has no node to lose; set nodes to 2 or more, or remove elastic")
    elif e.min_nodes > nodes:
        out.append(f"elastic.min_nodes {e.min_nodes} is more than nodes {nodes}; "
                   f"set min_nodes between 1 and {nodes} (nodes is the maximum)")
    if rendezvous.backend == "static" and "backend" in rendezvous.model_fields_set:
        out.append("elastic needs c10d rendezvous (node ranks are assigned anew at each restart); "
                   "remove rendezvous.backend: static (elastic implies c10d) or set it to c10d")
    if e.keep_global_batch and command.module != TRAIN_MODULE:
        out.append(f"elastic.keep_global_batch adjusts {TRAIN_MODULE}'s gradient accumulation; command runs "
                   "another program: set keep_global_batch: false and keep the global batch in your program")
    return out


def layout_problems(strategy: str, nodes: int, nproc_per_node: int, devices_per_process: int,
                    command: Command) -> list[str]:
    """The device layout must fit one node, and the ddpkit entrypoint's own
    flags must say the same thing as the fields that size the GPU requests
    (otherwise a target would request GPUs the processes never use, or too few)."""
    out = []
    world_size = nodes * nproc_per_node
    if strategy == "dp" and world_size != 1:
        out.append(f"strategy: dp runs one process, but nodes x nproc_per_node is {world_size}; "
                   "set nodes: 1 and nproc_per_node: 1, or use strategy: ddp")
    if nproc_per_node * devices_per_process > MAX_GPUS_PER_NODE:
        out.append(f"nproc_per_node {nproc_per_node} x devices_per_process {devices_per_process} "
                   f"needs more than {MAX_GPUS_PER_NODE} GPUs per node; lower one of them")
    if command.module != TRAIN_MODULE:
        return out  # another program's flags are its own business
    args = command.args
    flagged = flag_value(args, STRATEGY_FLAG) or "ddp"
    if flagged != strategy:
        out.append(f"command.args runs --strategy {flagged} but strategy is {strategy}; "
                   f"set strategy: {flagged} (it sizes every GPU request)")
    dpp = flag_value(args, DEVICES_PER_PROCESS_FLAG)
    if strategy == "ddp" and str(devices_per_process) != (dpp or "1"):
        out.append(f"command.args has {DEVICES_PER_PROCESS_FLAG} {dpp or 1} but devices_per_process is "
                   f"{devices_per_process}; make them equal (the field sizes every GPU request)")
    return out
