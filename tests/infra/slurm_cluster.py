"""A real Slurm cluster on this machine, for tests.

Hosts are network namespaces on a private bridge (tests/infra/netns.py):
`slurmctl` runs slurmctld and is where jobs are submitted from; `node1`,
`node2`, ... each run one `slurmd -N nodeI`. One private munged (own key,
own socket) serves them all: its socket is a path on the shared filesystem,
which every network namespace can reach.

Choices, and why:
- ProctrackType=proctrack/linuxproc and TaskPlugin=task/none: no cgroup
  plugin, so nothing depends on the cgroup layout of the test machine.
- No slurmdbd by default: accounting_storage/none. Finished jobs stay
  visible to `scontrol show job` for MinJobAge seconds, which is what tests
  and `ddpkit submit slurm --follow` read the final state from.
  `accounting=True` adds what a site with accounting runs: a MariaDB server
  and slurmdbd on the controller's host (its own loopback, its own data
  folder), the cluster added with sacctmgr, and slurmctld storing jobs
  there (accounting_storage/slurmdbd), so `sacct` answers for ended jobs.
- CPUs per node are declared (8) rather than detected, with
  SlurmdParameters=config_overrides, so two 2-task jobs fit on the same
  nodes at once on a 2-core machine.
- AuthInfo cred_expire=10: a requeued job becomes eligible again only after
  the credential lifetime (default 120 s), which would make the preemption
  test sit idle for two minutes.
- sched_interval=2: a requeued job that becomes eligible starts within
  seconds instead of at the next 60 s scheduling pass.
- Node features `ddp` (every node) and `rackI` (node I only), so that
  `--constraint` is checked against real node features.
- Everything lives under one folder; SLURM_CONF points every command there.

Torn down on exit: daemons stopped, every process in the namespaces killed,
namespaces removed, munged stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from . import netns

VENV_BIN = Path(__file__).resolve().parents[2] / ".venv" / "bin"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
ACCOUNTING_DAEMONS = ("slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")
CPUS_PER_NODE = 8
DB_USER, DB_PASS, DB_PORT, DBD_PORT = "slurm", "ddpkit-test", 3306, 6819


def available() -> str | None:
    """None when a cluster can be built here, else a one-line skip reason."""
    reason = netns.available()
    if reason:
        return reason
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"needs Slurm and munge ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    return None


def accounting_available() -> str | None:
    """None when a cluster with accounting can be built here, else a skip reason."""
    missing = [d for d in ACCOUNTING_DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return (f"needs slurmdbd and MariaDB ({', '.join(missing)} missing: "
                "apt-get install slurmdbd mariadb-server)")
    return None


def node_features(name: str) -> str:
    """Features of node `nodeI`: `ddp` on every node, `rackI` on node I
    alone, so a constraint can match all nodes or exactly one."""
    return f"ddp,rack{name.removeprefix('node')}"


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class JobInfo:
    """The fields of `scontrol show job -o` that tests care about."""

    job_id: int
    state: str
    exit_code: str
    restarts: int
    nodes: str
    raw: dict[str, str]

    @classmethod
    def parse(cls, line: str) -> JobInfo:
        raw = {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", line)}
        return cls(int(raw["JobId"]), raw["JobState"], raw.get("ExitCode", ""),
                   int(raw.get("Restarts", "0")), raw.get("NodeList", ""), raw)

    @property
    def finished(self) -> bool:
        return self.state in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@dataclass
class SlurmCluster:
    """`with SlurmCluster(workdir, nodes=2) as cluster:` a running cluster."""

    workdir: Path
    nodes: int = 2
    prefix: str = field(default_factory=lambda: f"sl{os.getpid() % 100000}")
    accounting: bool = False  # slurmdbd + MariaDB (see the module docstring)
    net: netns.Network | None = field(default=None, init=False)
    _procs: list[subprocess.Popen[str]] = field(default_factory=list, init=False)
    _slurmd: dict[str, subprocess.Popen[str]] = field(default_factory=dict, init=False)
    _db_procs: list[subprocess.Popen[str]] = field(default_factory=list, init=False)  # MariaDB, slurmdbd

    @property
    def node_names(self) -> list[str]:
        return [f"node{i + 1}" for i in range(self.nodes)]

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def ctl(self) -> netns.Host:
        assert self.net is not None, "cluster not started"
        return self.net["slurmctl"]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for commands run against this cluster: its config, and
        the project's venv first on PATH (the nodes share this filesystem)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}:/usr/sbin:/sbin"
        return env | (extra or {})

    # ---- lifecycle ----------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net = netns.Network(["slurmctl", *self.node_names], prefix=self.prefix).__enter__()
        try:
            self.net.name_v4_mapped()  # what a job's output shows: no c10d warning per connection
            self.net.wait_reachable()
            self._start_munge()
            self._write_conf()
            if self.accounting:
                self._start_accounting()
            self._start_slurm()
            self.wait_nodes_idle()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # slurmctld first, then the slurmds, munged last (started first).
        # After jobs ran, slurmctld often does not exit on SIGTERM at all
        # ("Saving all slurm state", then a stuck RPC write): waiting 10 s
        # for it cost every teardown 10 s. Its state is thrown away (a new
        # cluster starts with -i in a new folder), so 2 s, then SIGKILL.
        # With accounting: slurmdbd and MariaDB after the Slurm daemons that write to them.
        for proc in [*self._procs[1:], *reversed(self._db_procs), *self._procs[:1]]:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        self._db_procs.clear()
        self._slurmd.clear()
        if self.net is not None:
            self.net.__exit__(None, None, None)
            self.net = None

    def _log(self, name: str) -> TextIO:
        return open(self.workdir / f"{name}.out", "w")

    def _start_munge(self) -> None:
        munge = self.workdir / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = munge / "munge.socket"
        proc = subprocess.Popen(
            [_sbin("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"],
            stdout=self._log("munged"), stderr=subprocess.STDOUT, text=True)
        self._procs.append(proc)
        _wait_for(lambda: self.munge_socket.exists() or proc.poll() is not None, 10, "munged socket")
        if proc.poll() is not None:
            raise RuntimeError(f"munged exited: {(self.workdir / 'munged.out').read_text()}")

    def _write_conf(self) -> None:
        w = self.workdir
        for sub in ("state", "spool"):
            (w / sub).mkdir(exist_ok=True)
        (w / "plugstack.conf").write_text("")  # keep the system's SPANK plugins out
        assert self.net is not None
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs={CPUS_PER_NODE} "
                          f"Features={node_features(h.name)} State=UNKNOWN"
                          for h in self.net.hosts if h.name != "slurmctl")
        self.conf.write_text(f"""\
ClusterName=ddpkit-test
SlurmctldHost=slurmctl({self.ctl.addr})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={w}/slurmctld.log
SlurmdLogFile={w}/slurmd-%n.log
PlugStackConfig={w}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
{self._accounting_conf()}
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=30
{nodes}
PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")

    def _accounting_conf(self) -> str:
        if not self.accounting:
            return "AccountingStorageType=accounting_storage/none"
        # AccountingStoragePass: with munge, the socket that authenticates to slurmdbd (this cluster's munged)
        return (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                f"AccountingStoragePort={DBD_PORT}\nAccountingStoragePass={self.munge_socket}")

    def _start_accounting(self) -> None:
        """MariaDB, then slurmdbd, both in the controller's namespace (127.0.0.1
        there is this cluster's alone); the cluster added once slurmdbd answers."""
        db = self.workdir / "mariadb"
        sock = db / "mysqld.sock"
        init = subprocess.run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={db}",
                               "--auth-root-authentication-method=normal", "--skip-test-db"],
                              capture_output=True, text=True, check=False, timeout=120)
        if init.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {init.stdout}{init.stderr}")
        mariadb = self.ctl.popen(
            [_sbin("mariadbd"), "--no-defaults", "--user=root", f"--datadir={db}", f"--socket={sock}",
             f"--pid-file={db / 'mysqld.pid'}", f"--port={DB_PORT}", "--bind-address=127.0.0.1",
             "--skip-log-bin", "--innodb-buffer-pool-size=16M"],
            stdout=self._log("mariadbd"), stderr=subprocess.STDOUT)
        self._db_procs.append(mariadb)
        _wait_for(lambda: sock.exists() or mariadb.poll() is not None, 60, "the MariaDB socket")
        grant = (f"CREATE USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}'; "
                 f"GRANT ALL ON *.* TO '{DB_USER}'@'127.0.0.1';")
        made = self.ctl.run(["mariadb", "--no-defaults", f"--socket={sock}", "-u", "root", "-e", grant])
        if made.returncode != 0:
            raise RuntimeError(f"MariaDB user: {made.stderr} (log {self.workdir / 'mariadbd.out'})")
        # slurmdbd reads slurmdbd.conf beside slurm.conf, and only when SlurmUser alone may read it.
        dbd_conf = self.workdir / "slurmdbd.conf"
        dbd_conf.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={DBD_PORT}
SlurmUser=root
PidFile={self.workdir}/slurmdbd.pid
LogFile={self.workdir}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={DB_PORT}
StorageUser={DB_USER}
StoragePass={DB_PASS}
StorageLoc=slurm_acct_db
""")
        dbd_conf.chmod(0o600)
        dbd = self.ctl.popen([_sbin("slurmdbd"), "-D"], env=self.env(), stdout=self._log("slurmdbd"),
                             stderr=subprocess.STDOUT)
        self._db_procs.append(dbd)

        said: list[str] = []

        def cluster_added() -> bool:
            if dbd.poll() is not None:
                raise RuntimeError(f"slurmdbd exited; log {self.workdir / 'slurmdbd.log'}")
            done = self.run(["sacctmgr", "-i", "add", "cluster", "ddpkit-test"])
            said[:] = [done.stdout + done.stderr]
            return done.returncode == 0
        try:
            _wait_for(cluster_added, 60, f"slurmdbd to answer sacctmgr (logs in {self.workdir})", period=0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; sacctmgr said: {said[0].strip() if said else 'nothing'}") from None

    def _start_slurm(self) -> None:
        assert self.net is not None
        env = self.env()
        ctld = self.ctl.popen([_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=env,
                              stdout=self._log("slurmctld"), stderr=subprocess.STDOUT)
        self._procs.append(ctld)
        for name in self.node_names:
            self._start_slurmd(name)

    def _start_slurmd(self, name: str) -> None:
        assert self.net is not None
        proc = self.net[name].popen([_sbin("slurmd"), "-D", "-N", name, "-f", str(self.conf)], cgroup=True,
                                    env=self.env(), stdout=self._log(f"slurmd-{name}"), stderr=subprocess.STDOUT)
        self._procs.append(proc)
        self._slurmd[name] = proc

    def daemon_pids(self) -> set[int]:
        """The PIDs of slurmctld and the slurmds that run now."""
        return {p.pid for p in self._procs if p.poll() is None}

    def restart_dead_slurmds(self) -> list[str]:
        """Start slurmd again on every node whose slurmd is gone (a test
        killed the node's processes); the nodes restarted."""
        dead = [name for name, proc in self._slurmd.items() if proc.poll() is not None]
        for name in dead:
            self._procs.remove(self._slurmd.pop(name))
            self._start_slurmd(name)
        return dead

    def wait_nodes_idle(self, timeout: float = 60) -> None:
        def idle() -> bool:
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a Slurm daemon exited: {dead}; logs in {self.workdir}")
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
            return out.count("idle") == self.nodes
        _wait_for(idle, timeout, f"{self.nodes} idle nodes (logs in {self.workdir})")

    # ---- using it -----------------------------------------------------------

    def run(self, cmd: list[str], *, cwd: Path | None = None, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command on the submit host (slurmctl) against this cluster."""
        return self.ctl.run(cmd, cwd=cwd, timeout=timeout, env=self.env(env))

    def sbatch(self, script: Path, *extra: str, env: dict[str, str] | None = None) -> int:
        result = self.run(["sbatch", "--parsable", *extra, str(script)], cwd=script.parent, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> JobInfo:
        result = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        if result.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {result.stderr}")
        return JobInfo.parse(result.stdout)

    def wait(self, job_id: int, timeout: float = 120) -> JobInfo:
        """Block until the job reaches a final state."""
        info: list[JobInfo] = []

        def done() -> bool:
            info[:] = [self.job(job_id)]
            return info[0].finished
        _wait_for(done, timeout, f"job {job_id} to finish", period=0.5)
        return info[0]

    def wait_state(self, job_id: int, states: set[str], timeout: float = 60) -> JobInfo:
        info: list[JobInfo] = []

        def reached() -> bool:
            info[:] = [self.job(job_id)]
            return info[0].state in states
        _wait_for(reached, timeout, f"job {job_id} to reach {sorted(states)}", period=0.3)
        return info[0]


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str, period: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(period)
