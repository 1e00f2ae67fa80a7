"""What every worker of a program of the user's own gets before the
program's first line, with no change to its code: a torchrun script, a
Hugging Face or Lightning `Trainer`, anything that makes a torch process
group. ddpkit's own programs (`-m ddpkit.*`) do all of this themselves.

- `interface`: the spec's `network.interface` (`auto`: the interface that
  routes to the master) set as NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
  before the program creates its process group (interface.py);
- `rank_report`: once the program's `init_process_group` returns, the rank
  table and its checks, exchanged through the process group's store, never
  through the program's own collectives (ranks.py);
- `progress`: an optimizer step is a training step for the hang watchdog
  (torch's global optimizer-step hook), a `torch.save` is a checkpoint
  phase, and calls made by the program's main thread are signs of life
  between steps (an evaluation, a slow first step); progress.py. Its
  start-up is watched from `init_process_group`'s return: a rank still
  starting while another waits for it is named (startup.py);
- `metrics`: step times, samples per second and the loss as `ddpkit
  train`'s metrics records, where the launcher names a file for them
  (DDPKIT_METRICS), for `ddpkit report`; metrics.py;
- `stragglers`: each rank's own work per optimizer step (its DDP model's
  forward and backward, not the wait in the all-reduce) timed for the hang
  watchdog's straggler judge, which names a slow rank as it does in `ddpkit
  train` (stragglers.py);
- `stop`: a stop signal (SIGTERM, SIGUSR2) runs the program's stop handlers
  (`ddpkit.on_stop`, ddpkit.frameworks' callbacks) at the same optimizer step
  on every rank, then the process exits 75; without one, it ends the process
  as before, with one line that says so; stop.py. On a requeued or restarted
  job, rank 0 says at the first optimizer step whether the program loaded a
  checkpoint before it or starts over (resumed.py).

With any part on, a rich progress bar (Lightning's default) prints a line
every 10 s where its output is no terminal, as a tqdm bar does (bars.py).

It is installed by the agent's zygote in every forked worker and by
`python -m ddpkit.run PROGRAM ARGS` wherever nothing forks the workers.
DDPKIT_PREAMBLE=off leaves it all out; a comma list names parts to leave out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from ..shared.agreed import is_ddpkit_module, preamble_parts


def is_own_program(argv: Sequence[str]) -> bool:
    """ddpkit's own programs (`-m ddpkit.train`, `-m ddpkit.doctor`) report for themselves."""
    return len(argv) >= 2 and argv[0] == "-m" and is_ddpkit_module(argv[1])


def install(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Install the wanted parts for the program `argv` ("-m", module, ... or
    script, ...); the parts installed. A part that cannot be installed says
    why in one line and ends the process (the program would fail later, with
    a less clear cause)."""
    if is_own_program(argv):
        return ()
    from . import interface, metrics, progress, ranks, stop, stragglers

    steps: dict[str, Callable[[Mapping[str, str]], None]] = {
        "interface": interface.install, "rank_report": ranks.install, "progress": progress.install,
        "metrics": metrics.install_from, "stragglers": stragglers.install, "stop": stop.install}
    parts = preamble_parts(env)
    for part in parts:
        steps[part](env)
    if parts:
        from . import bars

        bars.install()
    return parts
