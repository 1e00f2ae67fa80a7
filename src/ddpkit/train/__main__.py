"""`python -m ddpkit.train` is `ddpkit train`: the program torchrun starts,
or (Slurm's srun mode) srun itself, one task per process. There, with no
agent to fold it, an uncaught error is said as a worker's is (agent/worker.py:
in a Slurm job one line, its traceback in the node's log) and a failure leaves
the node's failure file (agent/nodefailure.py)."""

import os
import sys

from ..shared.exitcodes import ExitCode
from .argcheck import train_parser, unknown_options_line
from .main import run


def main(argv: list[str] | None = None) -> int:
    parser = train_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        # One line per rank, not the usage once per rank.
        print(unknown_options_line(parser, extras), file=sys.stderr)
        return ExitCode.BAD_INPUT
    return run(args)


def main_alone() -> int:
    """main() as an agent-less task: its uncaught error said as a worker's, and a
    failure left for the batch script. Under torchrun's agent, the agent does both."""
    from ..agent import nodefailure, worker
    from ..shared.envnames import TORCHELASTIC_RUN_ID

    if TORCHELASTIC_RUN_ID in os.environ:
        return main()
    try:
        code = main()
    except SystemExit as exc:  # its argument parser's refusal (2), said already
        code = worker.exit_status(exc)
    except Exception:
        worker.print_exception(skipping=(worker.__name__, __name__))
        code = ExitCode.FAILED
    nodefailure.task_ended(code, stopped=False)
    return code


if __name__ == "__main__":
    sys.exit(main_alone())
