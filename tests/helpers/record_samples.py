"""`python -m tests.helpers.record_samples <ddpkit train flags>`: ddpkit train,
recording which training samples this process consumes, in order.

Wraps SyntheticImages.__getitem__ in this process (use --workers 0 so the
loader fetches here, and --no-eval so only the training set is read) and, at
exit, writes the indices to $DDPKIT_TEST_SAMPLES_DIR/rank<RANK>.json
atomically (temporary file, then os.replace)."""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

from ddpkit.train.__main__ import main
from ddpkit.train.data import loaders as data

SAMPLES_DIR = "DDPKIT_TEST_SAMPLES_DIR"
consumed: list[int] = []
_real_getitem = data.SyntheticImages.__getitem__


def _recording_getitem(self: data.SyntheticImages, index: int) -> tuple[object, int]:
    consumed.append(int(index))
    return _real_getitem(self, index)


def _write() -> None:
    out = Path(os.environ[SAMPLES_DIR]) / f"rank{os.environ.get('RANK', '0')}.json"
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(consumed))
    os.replace(tmp, out)


if __name__ == "__main__":
    data.SyntheticImages.__getitem__ = _recording_getitem  # type: ignore[method-assign,assignment]
    atexit.register(_write)
    sys.exit(main())
