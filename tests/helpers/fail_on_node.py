"""A stand-in job for fail-fast tests: the processes on node $FAIL_NODE
(default 1; 'none' for no failure) exit 1 once every process of the job has
started (each touches a file in $STARTED_DIR); all others wait far longer
than any test allows, to be stopped. Each prints its pid when it starts."""

import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    node, local = os.environ["DDPKIT_NODE_RANK"], os.environ["LOCAL_RANK"]
    print(f"STARTED node={node} local={local} pid={os.getpid()}", flush=True)
    started = Path(os.environ["STARTED_DIR"])
    (started / f"{node}-{local}").touch()
    if node == os.environ.get("FAIL_NODE", "1"):
        while len(list(started.iterdir())) < int(os.environ["WORLD_SIZE"]):
            time.sleep(0.1)
        sys.exit(1)
    time.sleep(3600)
