"""The documentation site: `mkdocs build --strict` builds it (a broken link, an
anchor that does not exist, a page left out of the nav or a nav entry without
its page fails), its generated reference pages are there, and headless
Chromium opens it from file:// (no server, no network): the getting-started
page, a guide, the spec reference, and a search for `loss_s` that lists the
watchdog.loss_s field. Each page's screenshot is kept in
.pytest_cache/docs-screenshots/ for a person to look at.

Chromium is driven over its DevTools pipe (--remote-debugging-pipe: JSON
messages on file descriptors 3 and 4), so that the test reads the DOM after
the page's JavaScript (search runs in a web worker) has drawn it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / ".pytest_cache" / "docs-screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/system-deps.sh installs it)")
WAIT_S = 30  # the longest a page may take to show what a test waits for


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once, strictly, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, "mkdocs build --strict failed:\n" + done.stdout[-4000:] + done.stderr[-4000:]
    return out


def test_the_reference_pages_are_generated_and_not_in_docs(site: Path) -> None:
    for page in ("spec", "cli", "exit-codes", "environment"):
        assert (site / "reference" / f"{page}.html").is_file(), f"reference/{page} was not generated"
        assert not (ROOT / "docs" / "reference" / f"{page}.md").exists(), f"docs/reference/{page}.md is generated: remove it"
    spec = (site / "reference" / "spec.html").read_text()
    assert "watchdog.loss_s" in spec and "renders it" in spec
    assert "--nproc-per-node" in (site / "reference" / "cli.html").read_text()
    assert "NODE_LOST" in (site / "reference" / "exit-codes.html").read_text()
    assert "DDPKIT_WATCHDOG_LOSS_S" in (site / "reference" / "environment.html").read_text()


def test_search_works_offline(site: Path) -> None:
    # Material's offline plugin ships the index as a script a file:// page can load
    assert (site / "search" / "search_index.js").is_file()


@dataclass
class DevTools:
    """A headless Chromium and one page of it, over the DevTools pipe."""

    process: subprocess.Popen[bytes]
    to_browser: int
    from_browser: int
    session: str = ""
    next_id: int = 0
    buffer: bytes = b""
    pending: list[dict[str, Any]] = field(default_factory=list)

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return dict(json.loads(message))

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command (to the page once attached) and return its result."""
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True,
                           timeout=WAIT_S * 1000)
        if "exceptionDetails" in result:
            raise AssertionError(result["exceptionDetails"].get("exception", {}).get("description", result))
        return result["result"].get("value")

    def wait_for(self, condition: str) -> None:
        """Resolve once the JavaScript `condition` holds, checked at each frame the page draws."""
        self.evaluate(f"""new Promise((resolve, reject) => {{
            const give_up = Date.now() + {WAIT_S * 1000};
            const check = () => {{
                if ({condition}) resolve(true);
                else if (Date.now() > give_up) reject(new Error("never true: " + {json.dumps(condition)}));
                else requestAnimationFrame(check);
            }};
            check();
        }})""")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


def _as_fds_3_and_4(commands: int, replies: int) -> None:
    """In the child: `commands` on fd 3, `replies` on fd 4 (copied first, so neither clobbers the other)."""
    commands, replies = os.dup(commands), os.dup(replies)
    os.dup2(commands, 3)
    os.dup2(replies, 4)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevTools]:
    assert CHROMIUM is not None
    profile = tmp_path_factory.mktemp("chromium-profile")
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # chromium reads commands on fd 3 and writes replies on fd 4
    process = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         f"--user-data-dir={profile}", "--window-size=1280,900", "--remote-debugging-pipe", "about:blank"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        pass_fds=(3, 4), preexec_fn=lambda: _as_fds_3_and_4(to_browser_r, from_browser_w))
    os.close(to_browser_r)
    os.close(from_browser_w)
    tools = DevTools(process, to_browser_w, from_browser_r)
    try:
        target = tools.call("Target.createTarget", url="about:blank")["targetId"]
        tools.session = tools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        tools.call("Page.enable")
        tools.call("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
        yield tools
    finally:
        process.kill()
        process.wait()
        os.close(to_browser_w)
        os.close(from_browser_r)


def _visible_text(browser: DevTools) -> str:
    return str(browser.evaluate("document.querySelector('article').innerText"))


@needs_chromium
@pytest.mark.parametrize(("page", "title"), [
    ("getting-started.html", "Getting started"),
    ("guides/slurm.html", "Slurm"),
    ("reference/spec.html", "Job spec"),
])
def test_a_page_opens_from_file_with_its_title_and_navigation(site: Path, browser: DevTools, page: str,
                                                              title: str) -> None:
    browser.open((site / page).as_uri())
    browser.wait_for("document.querySelector('article h1') !== null")
    browser.screenshot(SHOTS / (page.replace("/", "-").removesuffix(".html") + ".png"))
    heading = str(browser.evaluate("document.querySelector('article h1').innerText"))
    assert title.lower() in heading.lower(), f"{page}: its heading is {heading!r}"
    assert len(_visible_text(browser)) > 300, f"{page}: almost nothing is shown"
    nav = str(browser.evaluate("document.querySelector('nav.md-nav--primary').innerText"))
    assert "Reference" in nav and "Guides" in nav, f"{page}: the navigation is missing: {nav[:300]!r}"


@needs_chromium
def test_search_for_loss_s_finds_the_watchdog_field(site: Path, browser: DevTools) -> None:
    # Material opens its search with ?q= and shows the results its web worker finds
    browser.open((site / "index.html").as_uri() + "?q=loss_s")
    browser.wait_for("document.querySelectorAll('.md-search-result__item').length > 0")
    browser.screenshot(SHOTS / "search-loss_s.png")
    results = str(browser.evaluate("document.querySelector('.md-search-result').innerText"))
    assert "watchdog.loss_s" in results, f"the search for loss_s does not list the field:\n{results[:2000]}"
    links = browser.evaluate("[...document.querySelectorAll('.md-search-result__link')].map(a => a.href)")
    assert any("reference/spec.html#" in link for link in links), links
