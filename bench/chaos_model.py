"""`--model bench.chaos_model:paced`: ddpkit's tiny CNN whose every forward
pass first sleeps $CHAOS_PACE_S (default 0). The chaos run paces its steps so
that a run of a given number of steps lasts long enough for its faults on any
machine; the sleep changes the time a step takes, never what it computes, so
the fault-free reference runs the same model unpaced and must end with the
same weights, bit for bit."""

from __future__ import annotations

import os
import time
from typing import Any

from torch import nn

from ddpkit.train.model.tiny import cnn

PACE = "CHAOS_PACE_S"


def _pause(_module: nn.Module, _inputs: Any) -> None:
    time.sleep(float(os.environ.get(PACE, "0")))


def paced(num_classes: int = 10) -> nn.Sequential:
    model = cnn(num_classes)
    model[0].register_forward_pre_hook(_pause)
    return model
