"""A launcher started in the background, its console read as it comes:
the attack tests (tests/test_store_attack_*.py) wait on its lines, with a
deadline, while a stranger works on the job it runs."""

from __future__ import annotations

import re
import subprocess
import threading
import time


class Followed:
    """`proc`'s stdout (stderr merged into it), line by line, as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._ended = False  # the output ended: no line is coming
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self._ended = True
            self._seen.notify_all()

    @property
    def text(self) -> str:
        with self._seen:
            return "".join(self.lines)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match[str]:
        """The first match of `pattern` in a line; fails, with the output, when
        the launcher ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        with self._seen:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    match = re.search(pattern, line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    raise AssertionError(f"never saw {pattern!r}:\n{''.join(self.lines)[-4000:]}")
                self._seen.wait(left)

    def steps(self, pattern: str = r"\bstep (\d+)/") -> list[int]:
        """Every step number the output names (ddpkit train's progress lines), in order."""
        return [int(m.group(1)) for m in re.finditer(pattern, self.text)]

    def finish(self, timeout: float) -> int:
        """The launcher's exit code; killed when it outlives `timeout`."""
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
