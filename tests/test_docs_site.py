"""The documentation site: `mkdocs build --strict` builds it (a broken link, an
anchor that does not exist, a page left out of the nav or a nav entry without
its page fails), its generated reference pages are there, and headless
Chromium reads it served over http from 127.0.0.1 (as `make docs-serve` does;
the search's web worker does not run from file://): the getting-started page,
a guide, the spec reference, and a search for `loss_s` that lists the
watchdog.loss_s field. No page asks for anything but the local server. Each
page's screenshot is kept in .pytest_cache/docs-screenshots/ for a person to
look at.

Chromium is driven over its DevTools pipe (--remote-debugging-pipe: JSON
messages on file descriptors 3 and 4), so that the test reads the DOM after
the page's JavaScript (search runs in a web worker) has drawn it, and sees
every request the page and its workers make (the Network domain)."""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.helpers.chromium import CHROMIUM, HEADLESS, needs_chromium

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / ".pytest_cache" / "docs-screenshots"
WAIT_S = 30  # the longest a page may take to show what a test waits for
LOCAL_SCHEMES = {"data", "blob", "about"}  # made inside the page: no connection


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once, strictly, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, "mkdocs build --strict failed:\n" + done.stdout[-4000:] + done.stderr[-4000:]
    return out


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site's files without a log line per request on stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass(frozen=True)
class Server:
    """The site served on 127.0.0.1 at an ephemeral port."""

    host: str
    port: int

    def url(self, path: str = "") -> str:
        return f"http://{self.host}:{self.port}/{path}"


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[Server]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, name="docs-server", daemon=True)
    thread.start()
    try:
        yield Server("127.0.0.1", httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_the_reference_pages_are_generated_and_not_in_docs(site: Path) -> None:
    for page in ("spec", "cli", "exit-codes", "environment"):
        assert (site / "reference" / page / "index.html").is_file(), f"reference/{page} was not generated"
        assert not (ROOT / "docs" / "reference" / f"{page}.md").exists(), f"docs/reference/{page}.md is generated: remove it"
    spec = (site / "reference" / "spec" / "index.html").read_text()
    assert "watchdog.loss_s" in spec and "renders it" in spec
    assert "--nproc-per-node" in (site / "reference" / "cli" / "index.html").read_text()
    assert "NODE_LOST" in (site / "reference" / "exit-codes" / "index.html").read_text()
    assert "DDPKIT_WATCHDOG_LOSS_S" in (site / "reference" / "environment" / "index.html").read_text()


def test_the_search_index_has_the_watchdog_field(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = [doc["location"] for doc in index["docs"] if "watchdog.loss_s" in doc["title"]]
    assert any(loc.startswith("reference/spec/#") for loc in locations), locations


@dataclass(frozen=True)
class Request:
    """One request a page or one of its workers sent, and its answer's status (0: none yet, or it failed)."""

    id: str
    url: str
    status: int = 0


@dataclass
class DevTools:
    """A headless Chromium and one page of it, over the DevTools pipe; it
    records the requests of the page and of every worker it starts."""

    process: subprocess.Popen[bytes]
    to_browser: int
    from_browser: int
    session: str = ""
    next_id: int = 0
    buffer: bytes = b""
    requests: dict[tuple[str, str], Request] = field(default_factory=dict)
    workers: list[str] = field(default_factory=list)  # the script URL of each worker attached

    def _send(self, method: str, session: str, params: dict[str, Any]) -> int:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        return self.next_id

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return dict(json.loads(message))

    def _on_event(self, event: dict[str, Any]) -> None:
        method, params, session = event.get("method"), event.get("params", {}), event.get("sessionId", "")
        if method == "Target.attachedToTarget":
            # a worker, held until its requests are recorded too (waitForDebuggerOnStart)
            worker = params["sessionId"]
            self.workers.append(params["targetInfo"]["url"])
            self._send("Network.enable", worker, {})
            self._send("Runtime.runIfWaitingForDebugger", worker, {})
        elif method == "Network.requestWillBeSent":
            key = (session, params["requestId"])
            self.requests[key] = Request(params["requestId"], params["request"]["url"])
        elif method == "Network.responseReceived":
            key = (session, params["requestId"])
            if key in self.requests:
                self.requests[key] = Request(params["requestId"], self.requests[key].url, params["response"]["status"])

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command (to the page once attached) and return its result;
        the events that arrive meanwhile are recorded."""
        sent = self._send(method, self.session, params)
        while True:
            reply = self._read_message()
            if reply.get("id") == sent:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            if "method" in reply:
                self._on_event(reply)

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
        """Load `url`, its requests recorded from none."""
        self.requests.clear()
        self.workers.clear()
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
        [CHROMIUM, *HEADLESS, f"--user-data-dir={profile}", "--window-size=1280,900", "--remote-debugging-pipe", "about:blank"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        pass_fds=(3, 4), preexec_fn=lambda: _as_fds_3_and_4(to_browser_r, from_browser_w))
    os.close(to_browser_r)
    os.close(from_browser_w)
    tools = DevTools(process, to_browser_w, from_browser_r)
    try:
        target = tools.call("Target.createTarget", url="about:blank")["targetId"]
        tools.session = tools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        tools.call("Page.enable")
        tools.call("Network.enable")
        tools.call("Target.setAutoAttach", autoAttach=True, waitForDebuggerOnStart=True, flatten=True)
        tools.call("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
        yield tools
    finally:
        process.kill()
        process.wait()
        os.close(to_browser_w)
        os.close(from_browser_r)


def assert_only_the_server_was_asked(requests: list[Request], server: Server, page: str) -> None:
    """Every request of `page` (and of its workers) went to the local server and was answered without an error."""
    assert any(r.url.startswith(server.url()) for r in requests), f"{page}: no request was recorded: {requests}"
    elsewhere = [r.url for r in requests
                 if urlsplit(r.url).scheme not in LOCAL_SCHEMES and urlsplit(r.url).netloc != f"{server.host}:{server.port}"]
    assert not elsewhere, f"{page}: the page asked for something beside the local server: {elsewhere}"
    failed = [(r.url, r.status) for r in requests if r.status >= 400]
    assert not failed, f"{page}: the server refused these: {failed}"


def _visible_text(browser: DevTools) -> str:
    return str(browser.evaluate("document.querySelector('article').innerText"))


@needs_chromium
@pytest.mark.parametrize(("page", "title"), [
    ("getting-started/", "Getting started"),
    ("guides/slurm/", "Slurm"),
    ("reference/spec/", "Job spec"),
])
def test_a_page_opens_with_its_title_and_navigation_asking_only_the_local_server(
        server: Server, browser: DevTools, page: str, title: str) -> None:
    browser.open(server.url(page))
    browser.wait_for("document.querySelector('article h1') !== null")
    browser.screenshot(SHOTS / (page.strip("/").replace("/", "-") + ".png"))
    heading = str(browser.evaluate("document.querySelector('article h1').innerText"))
    assert title.lower() in heading.lower(), f"{page}: its heading is {heading!r}"
    assert len(_visible_text(browser)) > 300, f"{page}: almost nothing is shown"
    nav = str(browser.evaluate("document.querySelector('nav.md-nav--primary').innerText"))
    assert "Reference" in nav and "Guides" in nav, f"{page}: the navigation is missing: {nav[:300]!r}"
    assert_only_the_server_was_asked(list(browser.requests.values()), server, page)


@needs_chromium
def test_search_for_loss_s_finds_the_watchdog_field(server: Server, browser: DevTools) -> None:
    # Material opens its search with ?q= and shows the results its web worker finds
    browser.open(server.url("?q=loss_s"))
    browser.wait_for("document.querySelectorAll('.md-search-result__item').length > 0")
    browser.screenshot(SHOTS / "search-loss_s.png")
    results = str(browser.evaluate("document.querySelector('.md-search-result').innerText"))
    assert "watchdog.loss_s" in results, f"the search for loss_s does not list the field:\n{results[:2000]}"
    links = browser.evaluate("[...document.querySelectorAll('.md-search-result__link')].map(a => a.href)")
    targets = {(urlsplit(link).path, urlsplit(link).fragment) for link in links}
    assert ("/reference/spec/", "watchdogloss_s") in targets, f"no result links to the field's entry: {links}"
    assert any("/search/search_index.json" in r.url for r in browser.requests.values()), "the index was not fetched"
    assert any("/workers/search." in url for url in browser.workers), f"the search worker was not watched: {browser.workers}"
    assert_only_the_server_was_asked(list(browser.requests.values()), server, "search")


def test_a_request_beside_the_local_server_or_refused_fails() -> None:
    """The check above names what the page should not have asked for."""
    server = Server("127.0.0.1", 8123)
    local = [Request("1", server.url("guides/slurm/"), 200), Request("2", "data:image/svg+xml,<svg/>", 200)]
    assert_only_the_server_was_asked(local, server, "page")
    with pytest.raises(AssertionError, match=r"page: .*beside the local server: \['https://unpkg.com/lunr'\]"):
        assert_only_the_server_was_asked([*local, Request("3", "https://unpkg.com/lunr")], server, "page")
    with pytest.raises(AssertionError, match=r"page: .*beside the local server: \['http://127.0.0.1:9/x'\]"):
        assert_only_the_server_was_asked([*local, Request("3", "http://127.0.0.1:9/x")], server, "page")
    with pytest.raises(AssertionError, match=r"page: the server refused these: \[\('http://127.0.0.1:8123/a.js', 404\)\]"):
        assert_only_the_server_was_asked([*local, Request("3", server.url("a.js"), 404)], server, "page")
