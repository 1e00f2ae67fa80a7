"""What a job's output must read like after a normal stop (pre-emption,
cancel, requeue), as people read it (`tail -f slurm-JOBID.out`)."""

from __future__ import annotations

import re

# torch's agent's traceback and shutdown warnings, and c10d's reverse-lookup warning
# (which a Slurm job's agent moves to the node log: test_slurm_first_failure.py)
NOISE = ("Traceback", "SignalException", "death signal", "closing signal", "hostname of the client socket")


def assert_one_line_per_node(text: str, signal: str | None, nodes: int = 2, code: int = 75) -> None:
    """None of NOISE in `text` (srun-labelled output), and where torchrun's agent ran
    (`signal` given), one line from each node's agent: its worker stopped with `code`."""
    for noise in NOISE:
        assert noise not in text, f"{noise!r} in the output\n{text[-6000:]}"
    if signal is not None:
        said = re.findall(rf"^\d+: ddpkit\.agent: node (\d+): {signal}: its worker stopped \(exit {code}\)(?:; .*)?$",
                          text, re.MULTILINE)
        assert sorted(said) == [str(n) for n in range(nodes)], text[-6000:]
