"""`python -m tests.helpers.train_same_error <ddpkit train flags>`: ddpkit
train whose rank 1 raises the same ValueError at its third step, at every
start (a bug in a model's code, as the job sees it)."""

from __future__ import annotations

import os
import sys
from typing import Any

BAD_CALL, BAD_RANK = 3, 1
_calls = [0]


def _compute(self: Any, batches: Any) -> Any:
    _calls[0] += 1
    if _calls[0] == BAD_CALL and os.environ.get("RANK") == str(BAD_RANK):
        raise ValueError(f"the model's output has {_calls[0] * 7} columns, the loss wants {os.getpid()}")
    return _real_compute(self, batches)


if __name__ == "__main__":
    from ddpkit.train.__main__ import main
    from ddpkit.train.loop import steps

    _real_compute = steps.Stepper.compute
    steps.Stepper.compute = _compute  # type: ignore[method-assign]
    sys.exit(main())
