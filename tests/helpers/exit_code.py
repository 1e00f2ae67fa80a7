"""`python -m tests.helpers.exit_code <ddpkit train flags>`: ddpkit train, then
its exit code written to $DDPKIT_TEST_EXIT_DIR/rank<RANK>.code (temporary
file, then os.replace), because torchrun's agent does not report the exit
codes of workers it stopped on a signal. In-process: the signal handlers are
ddpkit train's own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpkit.train.__main__ import main

EXIT_DIR = "DDPKIT_TEST_EXIT_DIR"


def record(code: int) -> None:
    folder = Path(os.environ[EXIT_DIR])
    final = folder / f"rank{os.environ.get('RANK', '0')}.code"
    temp = final.with_suffix(".tmp")
    temp.write_text(str(code))
    os.replace(temp, final)


if __name__ == "__main__":
    code = 1  # an exception out of main is exit status 1, as Python's own
    try:
        code = main()
    finally:
        record(code)
    sys.exit(code)
