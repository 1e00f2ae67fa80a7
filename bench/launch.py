"""Fan-out benchmark: time from command to every rank running, on 2, 8 and
16 real sshd hosts (network namespaces), side by side in one run:

  ddpkit launch ssh       (paramiko, parallel, with preflight)
  ddpkit render ssh       (the standalone bash launcher, parallel `ssh`)
  pdsh -R ssh             (default fanout)
  serial ssh loop         (one `ssh host 'cmd &'` after another)

and the teardown time after an injected failure (one rank exits 1): until no
process of the run is left on any host.

The ranks are stand-ins (a shell script in place of the interpreter that
stamps the time it started, then sleeps), so the figures measure fan-out and
teardown, not torch's import time. Run as root:  .venv/bin/python -m bench.launch
Writes bench/results/launch.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.infra import netns, sshd  # noqa: E402

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
SIZES = (2, 8, 16)
HOLD_S = 3  # how long a healthy rank runs
FAIL_HOLD_S = 40  # healthy ranks in the failure run: far longer than any teardown
TEARDOWN_CAP_S = 15.0

# Stands in for python: answers the preflight's version probe, otherwise
# stamps "<host> <time>" into $MARKS and sleeps; $FAIL_HOST exits 1 instead.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then echo 2.15.0; exit 0; fi
host=$(hostname)
date +%s.%N > "$MARKS/$host"
if [ "$host" = "${FAIL_HOST:-}" ]; then sleep 1; date +%s.%N > "$MARKS/failed"; exit 1; fi
exec sleep "$HOLD"
"""


@dataclass
class Result:
    method: str
    hosts: int
    start_s: float | None
    teardown_s: float | None = None
    note: str = ""


class Bench:
    def __init__(self, net: netns.Network, ssh: sshd.SshHosts, folder: Path):
        self.net, self.ssh, self.folder = net, ssh, folder
        self.fake = folder / "fake-python"
        self.fake.write_text(FAKE_PYTHON)
        self.fake.chmod(0o755)
        self.runs = 0

    def new_run(self, n: int) -> tuple[Path, list[netns.Host]]:
        self.runs += 1
        marks = self.folder / f"run{self.runs}"
        marks.mkdir()
        return marks, self.net.hosts[1:n + 1]

    def job(self, marks: Path, n: int, hold: int, fail_host: str = "") -> Path:
        spec = {
            "name": f"bench{self.runs}", "nodes": n, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "master_port": 29600 + self.runs, "command": {"python": str(self.fake), "script": "rank.py"},
            "env": {"MARKS": str(marks), "HOLD": str(hold), "FAIL_HOST": fail_host},
            "ssh": {"log_dir": str(marks / "logs"), "grace_s": 2},
        }
        path = marks / "job.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    def hostfile(self, marks: Path, hosts: list[netns.Host]) -> Path:
        path = marks / "hostfile"
        path.write_text("".join(f"{h.addr}\n" for h in hosts))
        return path

    def remote_cmd(self, marks: Path, hold: int) -> str:
        return f"MARKS={marks} HOLD={hold} {self.fake} rank.py"

    def argv(self, method: str, marks: Path, hosts: list[netns.Host], hold: int, fail_host: str = "") -> list[str]:
        n = len(hosts)
        if method == "ddpkit launch ssh":
            return [DDPKIT, "launch", "ssh", "-f", str(self.job(marks, n, hold, fail_host)),
                    "--hostfile", str(self.hostfile(marks, hosts)), *self.ssh.launcher_flags()]
        if method == "ddpkit render ssh":
            job = self.job(marks, n, hold, fail_host)
            subprocess.run([DDPKIT, "render", "ssh", "-f", str(job), "-o", str(marks)], check=True, capture_output=True)
            return ["bash", str(marks / "launch.sh"), str(self.hostfile(marks, hosts))]
        if method == "pdsh":
            return ["pdsh", "-R", "ssh", "-w", ",".join(h.addr for h in hosts), self.remote_cmd(marks, hold)]
        if method == "serial ssh":
            loop = (f"for h in {' '.join(h.addr for h in hosts)}; do "
                    f"ssh -F {self.ssh.ssh_config} \"$h\" '{self.remote_cmd(marks, hold)} >/dev/null 2>&1 &'; done")
            return ["bash", "-c", loop]
        raise ValueError(method)

    def env(self) -> dict[str, str]:
        return {**os.environ, "DDPKIT_SSH_OPTS": f"-F {self.ssh.ssh_config}",
                "PDSH_SSH_ARGS_APPEND": f"-F {self.ssh.ssh_config}"}

    def start(self, method: str, n: int) -> Result:
        marks, hosts = self.new_run(n)
        argv = self.argv(method, marks, hosts, HOLD_S)
        t0 = time.time()
        proc = self.net["login"].popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env())
        stamps = wait_marks(marks, {h.name for h in hosts}, timeout=60)
        _, err = proc.communicate(timeout=120)
        if stamps is None:
            return Result(method, n, None, note=f"not all ranks started: {err[-300:]}")
        found = re.search(r"preflight ok on \d+ hosts in ([0-9.]+)s", err)
        return Result(method, n, max(stamps.values()) - t0, note=f"preflight {found[1]}s" if found else "")

    def teardown(self, method: str, n: int) -> Result:
        marks, hosts = self.new_run(n)
        fail_host = hosts[-1].name
        argv = self.argv(method, marks, hosts, FAIL_HOLD_S, fail_host)
        if method in ("pdsh", "serial ssh"):
            argv = [a.replace(f"MARKS={marks}", f"MARKS={marks} FAIL_HOST={fail_host}") for a in argv]
        proc = self.net["login"].popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env())
        failed = marks / "failed"
        deadline = time.time() + 60
        while not failed.exists() and time.time() < deadline:
            time.sleep(0.05)
        failed_at = float(failed.read_text())
        login_ns = os.stat(f"/run/netns/{self.net['login'].ns}").st_ino
        while running(str(marks), login_ns) and time.time() < failed_at + TEARDOWN_CAP_S:
            time.sleep(0.05)
        left = running(str(marks), login_ns)
        what = describe(left)
        gone = time.time() - failed_at
        if left:  # no fail-fast: clean up what the method left running
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        if left:
            return Result(method, n, None, None,
                          f"{len(left)} processes still running {TEARDOWN_CAP_S:.0f}s after the failure ({what})")
        return Result(method, n, None, gone)


def wait_marks(marks: Path, names: set[str], timeout: float) -> dict[str, float] | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        have = {p.name for p in marks.iterdir() if p.name in names}
        if have == names:
            time.sleep(0.05)  # a stamp is written in one go, but let the last one land
            return {name: float((marks / name).read_text()) for name in names}
        time.sleep(0.02)
    return None


def running(marker: str, exclude_netns: int) -> list[int]:
    """Processes of the run on the job hosts (the launcher's own namespace,
    `login`, is excluded: the question is whether the ranks are gone)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if os.stat(proc / "ns" / "net").st_ino == exclude_netns:
                    continue
                if marker.encode() in (proc / "cmdline").read_bytes() or marker.encode() in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def describe(pids: list[int]) -> str:
    names = []
    for pid in pids[:4]:
        try:
            names.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60])
        except OSError:
            pass
    return "; ".join(names)


METHODS = ("ddpkit launch ssh", "ddpkit render ssh", "pdsh", "serial ssh")


def table(results: list[Result], sizes: tuple[int, ...] = SIZES) -> str:
    by = {(r.method, r.hosts): r for r in results if r.start_s is not None}
    lines = ["time from command to every rank running (s), ratio to ddpkit launch ssh at the same size"]
    lines.append(f"{'method':<20}" + "".join(f"{n:>8} hosts  ratio" for n in sizes))
    for method in METHODS:
        cells = []
        for n in sizes:
            r, ref = by.get((method, n)), by.get(("ddpkit launch ssh", n))
            if r is None or r.start_s is None:
                cells.append(f"{'-':>14}{'':>7}")
                continue
            ratio = r.start_s / ref.start_s if ref is not None and ref.start_s else float("nan")
            cells.append(f"{r.start_s:>14.2f}{ratio:>7.2f}")
        lines.append(f"{method:<20}" + "".join(cells))
    lines.append("")
    lines.append(f"teardown after one rank exits 1 ({max(sizes)} hosts): until no process of the run is left on the hosts")
    for r in results:
        if r.start_s is None and (r.teardown_s is not None or r.note):
            shown = f"{r.teardown_s:.2f} s" if r.teardown_s is not None else r.note
            lines.append(f"  {r.method:<20} {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda t: tuple(int(x) for x in t.split(",")), default=SIZES)
    parser.add_argument("--methods", type=lambda t: tuple(t.split(",")), default=METHODS)
    args = parser.parse_args(argv)
    reason = netns.available() or sshd.available() or (None if shutil.which("pdsh") else "needs pdsh")
    if reason:
        print(f"bench/launch.py: {reason}", file=sys.stderr)
        return 2
    results: list[Result] = []
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-"))
    names = ["login", *(f"h{i:02d}" for i in range(1, max(args.sizes) + 1))]
    try:
        with netns.Network(names, prefix="dkbench", subnet="10.213.78") as net:
            net.wait_reachable(timeout=30)
            with sshd.SshHosts(net.hosts[1:], net.hosts[0], folder) as ssh:
                bench = Bench(net, ssh, folder)
                for n in args.sizes:
                    for method in args.methods:
                        results.append(bench.start(method, n))
                        print(f"  start {method:<20} {n:>2} hosts: {results[-1].start_s}", file=sys.stderr)
                for method in args.methods:
                    results.append(bench.teardown(method, max(args.sizes)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(table(results, args.sizes))
    out = ROOT / "bench" / "results" / "launch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
