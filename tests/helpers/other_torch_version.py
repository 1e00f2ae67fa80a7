"""`ddpkit train` as a node whose image carries another torch release: the
process reports torch.__version__ = $FAKE_TORCH_VERSION in its rank-report
row (nothing else changes). For the fault matrix only; ddpkit itself has no
hook for it."""

import os
import sys

import torch

if __name__ == "__main__":
    torch.__version__ = os.environ.get("FAKE_TORCH_VERSION", "0.0-other")  # type: ignore[assignment]
    from ddpkit.train.__main__ import main

    sys.exit(main())
