"""`ddpkit doctor` / `python -m ddpkit.doctor`: preflight checks on every
process and a collective benchmark, through the same launch path as the job.

Modules: results (rows), sizes (sizes, busbw), local (host checks), network
(interface, master, port), collectives (correctness, barrier), bench
(bandwidth), distributed (after joining), report (tables, JSON), main.
torch is imported inside functions only: `ddpkit --help` imports this."""

from .main import add_arguments, run

__all__ = ["add_arguments", "run"]
