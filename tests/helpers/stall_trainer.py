"""`ddpkit train`, where the rank named by STALL_RANK freezes itself with
SIGSTOP once it has finished STALL_AFTER_STEP steps (as `kill -STOP` from
outside would), first writing the time to STALL_MARK. For launchers whose
workers the test cannot reach by pid easily (SSH hosts, Slurm steps)."""

import os
import runpy
import signal
import sys
import threading
import time


def freeze_mid_run() -> None:
    from ddpkit.train.watchdog.stall_model import PULSE

    while PULSE.step < int(os.environ["STALL_AFTER_STEP"]):
        time.sleep(0.05)
    mark = os.environ["STALL_MARK"]
    with open(mark + ".tmp", "w") as out:
        out.write(f"{time.time()} {os.getpid()}")
    os.replace(mark + ".tmp", mark)  # whole, for a reader that polls the name
    os.kill(os.getpid(), signal.SIGSTOP)


# torchrun sets RANK; Slurm's srun mode starts each rank itself, with SLURM_PROCID.
if os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == os.environ["STALL_RANK"]:
    threading.Thread(target=freeze_mid_run, daemon=True).start()
sys.argv[0] = "ddpkit-train"
runpy.run_module("ddpkit.train", run_name="__main__", alter_sys=True)
