"""Debian's Chromium, headless, as the browser tests start it: no sandbox
(they run as root), and none of the background connections (updates,
sync, field trials) that this machine's closed network refuses."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/system-deps.sh installs it)")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
