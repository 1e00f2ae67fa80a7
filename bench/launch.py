"""Fan-out benchmark on real sshd hosts (network namespaces), side by side in
one run, every method once per repeat, interleaved:

start: time from the command to every rank running, for 2, 8 and 16 hosts
  ddpkit launch ssh       (paramiko, parallel; preflight checks every host first)
  ddpkit render ssh       (the standalone bash launcher, parallel `ssh`)
  pdsh                    (pdsh -R ssh, default fanout)
  serial ssh              (one `ssh host 'cmd &'` after another)
The ranks are stand-ins (a shell script in place of the interpreter that
stamps the time it started, then sleeps), so these figures measure fan-out,
not torch's import time.

teardown (stand-ins): one rank exits 1; time until no process of the run is
left on any host, for the same four methods on the largest size.

teardown (real torch): a plain DDP loop (gloo) started by `ddpkit launch
ssh` and by plain torchrun with a static rendezvous (`--node-rank i
--master-addr`) over a parallel ssh loop, the usual hand-written launch, and
two failures: one rank exits 1 mid-training; or one host is lost mid-training
(its link goes down: no reset reaches the others, as with a power loss).
Time until no process is left on the hosts still up.

Run as root:  .venv/bin/python -m bench.launch [--repeats 2]
Writes bench/results/launch.json and launch.png.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from tests.infra import netns, sshd  # noqa: E402

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
SIZES = (2, 8, 16)
HOLD_S = 1  # how long a healthy stand-in rank runs
FAIL_HOLD_S = 60  # healthy ranks in a failure run: far longer than any teardown
TEARDOWN_CAP_S = 20.0
LOST_CAP_S = 45.0  # host lost: ddpkit's keepalive needs alive_interval_s x alive_count (5 x 3 s) to call it
TORCH_HOSTS = 4
START_METHODS = ("ddpkit launch ssh", "ddpkit render ssh", "pdsh", "serial ssh")
TORCH_METHODS = ("ddpkit launch ssh", "torchrun static + ssh loop")
TITLES = {"start": "start: command -> every rank running (s); ratio = method / pdsh",
          "teardown": "teardown, stand-in ranks: one rank exits 1 -> no process left (s)",
          "teardown-torch": "teardown, real torch (plain DDP loop, gloo): one rank exits 1 -> no process left (s)",
          "host-lost-torch": "teardown, real torch: one host lost (link down) -> no process left on the others (s)"}

# Stands in for python: answers the preflight's version probe, otherwise
# stamps "<host> <time>" into $MARKS and sleeps; $FAIL_HOST exits 1 instead.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then echo 2.15.0; exit 0; fi
host=$(hostname)
# Marks are polled by the bench: write a temp file, then rename it into place.
mark() { date +%s.%N > "$MARKS/.$1.$$" && mv -f "$MARKS/.$1.$$" "$MARKS/$1"; }
mark "$host"
if [ "$host" = "${FAIL_HOST:-}" ]; then sleep 1; mark failed; exit 1; fi
exec sleep "$HOLD"
"""

# The plain DDP loop both launchers start in the real-torch teardown: every
# step all-reduces gradients; rank FAIL_RANK exits 1 once training runs.
PLAIN_DDP = """\
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def mark(name):
    # the bench polls for this file: write a temp file and rename it into place
    path = os.path.join(os.environ["MARKS"], name)
    with open(f"{path}.{os.getpid()}.tmp", "w") as out:
        out.write(repr(time.time()))
    os.replace(f"{path}.{os.getpid()}.tmp", path)
mark(f"rank{rank}")
for step in range(100000):
    if rank == int(os.environ["FAIL_RANK"]) and step == 20:
        mark("failed")
        sys.exit(1)
    opt.zero_grad()
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    time.sleep(0.05)
"""


@dataclass
class Result:
    kind: str  # a key of TITLES
    method: str
    hosts: int
    repeat: int
    seconds: float | None
    note: str = ""


class Bench:
    def __init__(self, net: netns.Network, ssh: sshd.SshHosts, folder: Path):
        self.net, self.ssh, self.folder = net, ssh, folder
        self.fake = folder / "fake-python"
        self.fake.write_text(FAKE_PYTHON)
        self.fake.chmod(0o755)
        self.plain = folder / "plain_ddp.py"
        self.plain.write_text(PLAIN_DDP)
        self.runs = 0

    def new_run(self, n: int) -> tuple[Path, list[netns.Host]]:
        self.runs += 1
        marks = self.folder / f"run{self.runs}"
        marks.mkdir()
        return marks, self.net.hosts[1:n + 1]

    @property
    def port(self) -> int:
        return 29600 + self.runs

    def job(self, marks: Path, n: int, command: dict, env: dict[str, str]) -> Path:
        spec = {
            "name": f"bench{self.runs}", "nodes": n, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "master_port": self.port, "command": command, "env": {"MARKS": str(marks), **env},
            "ssh": {"log_dir": str(marks / "logs"), "grace_s": 2},
        }
        path = marks / "job.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    def stand_in_job(self, marks: Path, n: int, hold: int, fail_host: str) -> Path:
        return self.job(marks, n, {"python": str(self.fake), "script": "rank.py"},
                        {"HOLD": str(hold), "FAIL_HOST": fail_host})

    def hostfile(self, marks: Path, hosts: list[netns.Host]) -> Path:
        path = marks / "hostfile"
        path.write_text("".join(f"{h.addr}\n" for h in hosts))
        return path

    def ddpkit_argv(self, job: Path, marks: Path, hosts: list[netns.Host]) -> list[str]:
        return [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile", str(self.hostfile(marks, hosts)),
                *self.ssh.launcher_flags()]

    def argv(self, method: str, marks: Path, hosts: list[netns.Host], hold: int, fail_host: str = "") -> list[str]:
        n = len(hosts)
        remote = f"MARKS={marks} HOLD={hold} FAIL_HOST={fail_host} {self.fake} rank.py"
        if method == "ddpkit launch ssh":
            return self.ddpkit_argv(self.stand_in_job(marks, n, hold, fail_host), marks, hosts)
        if method == "ddpkit render ssh":
            job = self.stand_in_job(marks, n, hold, fail_host)
            subprocess.run([DDPKIT, "render", "ssh", "-f", str(job), "-o", str(marks)], check=True, capture_output=True)
            return ["bash", str(marks / "launch.sh"), str(self.hostfile(marks, hosts))]
        if method == "pdsh":
            return ["pdsh", "-R", "ssh", "-w", ",".join(h.addr for h in hosts), remote]
        if method == "serial ssh":
            loop = (f"for h in {' '.join(h.addr for h in hosts)}; do "
                    f"ssh -F {self.ssh.ssh_config} \"$h\" '{remote} >/dev/null 2>&1 &'; done")
            return ["bash", "-c", loop]
        raise ValueError(method)

    def torch_argv(self, method: str, marks: Path, hosts: list[netns.Host], fail_rank: int) -> list[str]:
        n = len(hosts)
        env = {"FAIL_RANK": str(fail_rank), "OMP_NUM_THREADS": "1"}
        if method == "ddpkit launch ssh":
            job = self.job(marks, n, {"python": sys.executable, "script": str(self.plain)}, env)
            return self.ddpkit_argv(job, marks, hosts)
        if method == "torchrun static + ssh loop":
            exports = " ".join(f"{k}={v}" for k, v in {"MARKS": str(marks), **env}.items())
            torchrun = (f"{sys.executable} -m torch.distributed.run --nnodes={n} --nproc-per-node=1 "
                        f"--node-rank=$i --master-addr={hosts[0].addr} --master-port={self.port} {self.plain}")
            loop = (f"i=0; for h in {' '.join(h.addr for h in hosts)}; do "
                    f"ssh -F {self.ssh.ssh_config} \"$h\" \"{exports} {torchrun}\" & i=$((i + 1)); done; wait")
            return ["bash", "-c", loop]
        raise ValueError(method)

    def env(self) -> dict[str, str]:
        return {**os.environ, "DDPKIT_SSH_OPTS": f"-F {self.ssh.ssh_config}",
                "PDSH_SSH_ARGS_APPEND": f"-F {self.ssh.ssh_config}"}

    def start(self, method: str, n: int, repeat: int) -> Result:
        marks, hosts = self.new_run(n)
        argv = self.argv(method, marks, hosts, HOLD_S)
        t0 = time.time()
        proc = self.net["login"].popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env())
        stamps = wait_marks(marks, {h.name for h in hosts}, timeout=60)
        _, err = proc.communicate(timeout=120)
        if stamps is None:
            return Result("start", method, n, repeat, None, f"not all ranks started: {err[-300:]}")
        found = re.search(r"preflight ok on \d+ hosts in ([0-9.]+)s", err)
        return Result("start", method, n, repeat, max(stamps.values()) - t0,
                      f"preflight {found[1]}s" if found else "")

    def teardown(self, method: str, n: int, repeat: int) -> Result:
        marks, hosts = self.new_run(n)
        argv = self.argv(method, marks, hosts, FAIL_HOLD_S, hosts[-1].name)
        return self._teardown("teardown", method, n, repeat, marks, argv)

    def teardown_torch(self, method: str, n: int, repeat: int) -> Result:
        marks, hosts = self.new_run(n)
        return self._teardown("teardown-torch", method, n, repeat, marks,
                              self.torch_argv(method, marks, hosts, fail_rank=n - 1))

    def host_lost_torch(self, method: str, n: int, repeat: int) -> Result:
        marks, hosts = self.new_run(n)
        lost = hosts[-1]
        threading.Thread(target=cut_off_when_training, args=(lost, marks, n), daemon=True).start()
        try:
            return self._teardown("host-lost-torch", method, n, repeat, marks,
                                  self.torch_argv(method, marks, hosts, fail_rank=-1), lost=lost)
        finally:
            lost.run(["ip", "link", "set", lost.ifname, "up"], check=True)
            kill_all(running(str(marks), self.login_netns))  # what was left on the lost host

    def _teardown(self, kind: str, method: str, n: int, repeat: int, marks: Path, argv: list[str],
                  lost: netns.Host | None = None) -> Result:
        proc = self.net["login"].popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env())
        failed = marks / "failed"
        deadline = time.time() + 90  # a serial loop returns at once; its ranks run on
        while not failed.exists() and time.time() < deadline:
            time.sleep(0.05)
        # processes on a lost host cannot be reached by anyone: not counted
        skip = {self.login_netns, *([os.stat(f"/run/netns/{lost.ns}").st_ino] if lost else [])}
        if not failed.exists():
            proc.kill()
            proc.wait(60)
            kill_all(running(str(marks), *skip))
            return Result(kind, method, n, repeat, None, "the failure was never injected (run did not start)")
        failed_at, cap = float(failed.read_text()), LOST_CAP_S if lost else TEARDOWN_CAP_S
        while running(str(marks), *skip) and time.time() < failed_at + cap:
            time.sleep(0.05)
        left = running(str(marks), *skip)
        gone = time.time() - failed_at
        what = describe(left)
        kill_all(left)  # no fail-fast: clean up what the method left running
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        if left:
            return Result(kind, method, n, repeat, None,
                          f"{len(left)} processes still running {cap:.0f}s after the failure ({what})")
        return Result(kind, method, n, repeat, gone)

    @property
    def login_netns(self) -> int:
        return os.stat(f"/run/netns/{self.net['login'].ns}").st_ino


def cut_off_when_training(host: netns.Host, marks: Path, n: int) -> None:
    """Once every rank trains, take the host's link down and stamp the time."""
    wait_marks(marks, {f"rank{r}" for r in range(n)}, timeout=120)
    time.sleep(1.0)
    host.run(["ip", "link", "set", host.ifname, "down"], check=True)
    common.write_mark(marks / "failed", repr(time.time()))


def wait_marks(marks: Path, names: set[str], timeout: float) -> dict[str, float] | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        have = {p.name for p in marks.iterdir() if p.name in names}
        if have == names:
            return {name: float((marks / name).read_text()) for name in names}
        time.sleep(0.02)
    return None


def running(marker: str, *exclude_netns: int) -> list[int]:
    """Processes of the run on the job hosts (the launcher's own namespace,
    `login`, is excluded: the question is whether the ranks are gone)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if os.stat(proc / "ns" / "net").st_ino in exclude_netns:
                    continue
                if marker.encode() in (proc / "cmdline").read_bytes() or marker.encode() in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def describe(pids: list[int]) -> str:
    names = []
    for pid in pids[:4]:
        try:
            names.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60])
        except OSError:
            pass
    return "; ".join(names)


# ---- summary -------------------------------------------------------------------------
def summarise(results: list[Result]) -> list[dict]:
    """One row per (kind, method, hosts): spread of the runs that finished,
    the notes of those that did not, and the ratio to pdsh / to ddpkit."""
    rows: dict[tuple[str, str, int], dict] = {}
    for r in results:
        row = rows.setdefault((r.kind, r.method, r.hosts), {"kind": r.kind, "method": r.method, "hosts": r.hosts,
                                                            "seconds": [], "notes": []})
        if r.seconds is not None:
            row["seconds"].append(r.seconds)
        elif r.note:
            row["notes"].append(r.note)
    for row in rows.values():
        row["spread"] = common.spread(row["seconds"]) if row["seconds"] else None
    for row in rows.values():
        base = rows.get((row["kind"], "pdsh" if row["kind"] == "start" else "ddpkit launch ssh", row["hosts"]))
        if row["spread"] and base and base["spread"]:
            row["ratio_to_" + base["method"].replace(" ", "_")] = row["spread"]["mean"] / base["spread"]["mean"]
    return list(rows.values())


def print_summary(rows: list[dict]) -> None:
    for kind, title in TITLES.items():
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        print(title)
        table = []
        for r in mine:
            s = r["spread"]
            ratio = next((v for k, v in r.items() if k.startswith("ratio_to_")), None)
            if s:
                table.append([r["method"], r["hosts"], s["mean"], s["min"], s["max"], s["runs"],
                              f"{ratio:.2f}" if ratio is not None else "-"])
            else:
                table.append([r["method"], r["hosts"], "-", "-", "-", 0, r["notes"][0][:70] if r["notes"] else "-"])
        print(common.table(["method", "hosts", "mean", "min", "max", "runs", "ratio / note"], table))
        print()


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for method in START_METHODS:
        mine = sorted((r for r in rows if r["kind"] == "start" and r["method"] == method and r["spread"]),
                      key=lambda r: r["hosts"])
        if mine:
            xs, means = [r["hosts"] for r in mine], [r["spread"]["mean"] for r in mine]
            errs = [[m - r["spread"]["min"] for m, r in zip(means, mine)],
                    [r["spread"]["max"] - m for m, r in zip(means, mine)]]
            left.errorbar(xs, means, yerr=errs, marker="o", capsize=3, label=method)
    left.set_xlabel("hosts")
    left.set_ylabel("s until every rank runs (mean, min-max)")
    left.set_title("start")
    left.legend()
    bars = [r for r in rows if r["kind"] != "start"]
    what = {"teardown": "stand-in, rank exits", "teardown-torch": "torch, rank exits",
            "host-lost-torch": "torch, host lost"}
    labels = [f"{r['method']} ({what[r['kind']]}, {r['hosts']} hosts)" for r in bars]
    caps = {"host-lost-torch": LOST_CAP_S}
    values = [r["spread"]["mean"] if r["spread"] else caps.get(r["kind"], TEARDOWN_CAP_S) for r in bars]
    colors = ["#1f77b4" if r["spread"] else "#d62728" for r in bars]
    right.barh(labels, values, color=colors)
    right.axvline(10, color="#999999", linestyle="--", linewidth=1)
    right.set_xlabel("s until no process is left (red: still running when measuring stopped)")
    right.set_title("teardown after a failure")
    right.invert_yaxis()
    fig.suptitle(title)
    common.save_figure(fig, path)


# ---- main ----------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=lambda t: tuple(int(x) for x in t.split(",")), default=SIZES)
    p.add_argument("--methods", type=lambda t: tuple(t.split(",")), default=START_METHODS)
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of every start measurement")
    p.add_argument("--torch-hosts", type=int, default=TORCH_HOSTS,
                   help="hosts for the real-torch teardown (0: skip it)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--name", default="launch")
    return p.parse_args(argv)


def measure(bench: Bench, a: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    for repeat in range(a.repeats):
        for n in a.sizes:
            for method in a.methods:
                results.append(bench.start(method, n, repeat))
                print(f"  start    {method:<28} {n:>2} hosts: {results[-1].seconds}", file=sys.stderr)
    for method in a.methods:
        results.append(bench.teardown(method, max(a.sizes), 0))
        print(f"  teardown {method:<28}: {results[-1].seconds} {results[-1].note}", file=sys.stderr)
    if a.torch_hosts:
        for repeat in range(2):
            for method in TORCH_METHODS:
                results.append(bench.teardown_torch(method, a.torch_hosts, repeat))
                print(f"  teardown torch {method:<28}: {results[-1].seconds} {results[-1].note}", file=sys.stderr)
        for method in TORCH_METHODS:
            results.append(bench.host_lost_torch(method, a.torch_hosts, 0))
            print(f"  host lost torch {method:<28}: {results[-1].seconds} {results[-1].note}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    reason = netns.available() or sshd.available() or (None if shutil.which("pdsh") else "needs pdsh")
    if reason:
        print(f"bench/launch.py: {reason}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-"))
    hosts = max(*a.sizes, a.torch_hosts)
    names = ["login", *(f"h{i:02d}" for i in range(1, hosts + 1))]
    try:
        with netns.Network(names, prefix="dkbench", subnet="10.213.78") as net:
            net.wait_reachable(timeout=30)
            with sshd.SshHosts(net.hosts[1:], net.hosts[0], folder) as ssh:
                results = measure(Bench(net, ssh, folder), a)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = summarise(results)
    print_summary(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    png = a.out / f"{a.name}.png"
    plot(rows, png, "ddpkit SSH launch vs pdsh, a serial ssh loop and plain torchrun (namespace hosts, one machine)")
    path = common.write_result(a.name, {"command": common.command_line(), "machine": common.machine(),
                                        "sizes": list(a.sizes), "repeats": a.repeats, "summary": rows,
                                        "runs": [asdict(r) for r in results], "plot": png.name}, a.out)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
