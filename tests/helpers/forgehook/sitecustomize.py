"""Loaded by Python at start-up in processes whose PYTHONPATH starts with this
folder (tests/helpers/forge_rank_report.forge_env). Does nothing unless the
forge variable is set."""

import os
import sys
from pathlib import Path

_RAW = os.environ.get("DDPKIT_TEST_FORGE_RANK_REPORT")
if _RAW:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: `tests` importable
    from tests.helpers.forge_rank_report import install

    install(_RAW)
