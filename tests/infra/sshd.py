"""One real sshd per namespace host, with keys made by the test.

Everything lives in the test's own folder: host keys, one client key, a
private known_hosts and ssh_config. The real ~/.ssh is never read or written
(the launcher gets --known-hosts/--ssh-config/-i; `ssh` gets -F).

The hosts' rc files are the test's too. Each sshd runs in a mount namespace
of its own where the login user's ~/.bashrc, ~/.profile, ~/.bash_profile and
~/.bash_login (those that exist) are bind-mounted over by one file of the
test's: it sets the test runner's PATH and nothing else. The machine's own rc
files are not part of a test host: on the CI machine root's ~/.bashrc runs
`pyenv init`, whose rehash takes a lock file; a test that kills a host's
processes can kill a shell holding it, and from then on every ssh session
waits 60 s for the stale lock (CI, stop 23: 22 ssh tests failed at once).
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.infra.netns import Host

SSHD = Path("/usr/sbin/sshd")
LOGIN_USER = "root"  # what ssh_config's `User` says
HOME_RC_FILES = (".bashrc", ".profile", ".bash_profile", ".bash_login")

_SSHD_CONFIG = """\
Port 22
HostKey {host_key}
PidFile {folder}/sshd.pid
AuthorizedKeysFile {authorized}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PrintLastLog no
MaxStartups 500
MaxSessions 200
AllowTcpForwarding yes
LogLevel ERROR
"""


def available() -> str | None:
    """None when sshd hosts can run here, else the reason to skip."""
    for tool, package in ((str(SSHD), "openssh-server"), ("ssh-keygen", "openssh-client"), ("ssh", "openssh-client")):
        if shutil.which(tool) is None:
            return f"needs {tool} ({package})"
    return None


def _with_mounts(mounts: list[tuple[Path, Path]], argv: list[str]) -> list[str]:
    """`argv` in a private mount namespace where each (source, target) is
    bind-mounted: the targets change for it alone."""
    binds = "".join(f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))} && " for src, dst in mounts)
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f'{binds}exec "$@"', "sshd", *argv]


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddpkit-test", "-f", str(path)],
                   check=True, capture_output=True)
    return path


@dataclass
class SshHosts:
    """sshd on each of `hosts`; `login` is where launchers run (no sshd)."""

    hosts: list[Host]
    login: Host
    folder: Path
    # Stands in for /etc/bash.bashrc in the sshd's own mount namespace: the
    # file bash sources for commands run by sshd (see targets/sshnode.py).
    system_bashrc: Path | None = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def client_key(self) -> Path:
        return self.folder / "id_client"

    @property
    def known_hosts(self) -> Path:
        return self.folder / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.folder / "ssh_config"

    def host_key(self, host: Host) -> Path:
        return self.folder / host.name / "ssh_host_ed25519_key"

    def launcher_flags(self) -> list[str]:
        return ["--known-hosts", str(self.known_hosts), "--ssh-config", str(self.ssh_config),
                "-i", str(self.client_key)]

    def __enter__(self) -> SshHosts:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
        keygen(self.client_key)
        authorized = self.folder / "authorized_keys"
        authorized.write_text(self.client_key.with_suffix(".pub").read_text())
        try:
            for host in self.hosts:
                self.procs.append(self._start(host, authorized))
            self.write_known_hosts()
            self.write_ssh_config()
            self.wait_listening()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, host: Host, authorized: Path) -> subprocess.Popen[str]:
        folder = self.folder / host.name
        folder.mkdir(parents=True, exist_ok=True)
        if not self.host_key(host).exists():  # a restarted host keeps its key (known_hosts has it)
            keygen(self.host_key(host))
        config = folder / "sshd_config"
        config.write_text(_SSHD_CONFIG.format(host_key=self.host_key(host), folder=folder, authorized=authorized))
        log = (folder / "sshd.log").open("a")
        argv = [str(SSHD), "-D", "-e", "-f", str(config)]
        mounts = self._home_rc_mounts()
        if self.system_bashrc is not None:
            mounts = [*mounts, (self.system_bashrc, Path("/etc/bash.bashrc"))]
        return host.popen(_with_mounts(mounts, argv), stdout=log, stderr=subprocess.STDOUT)

    def _home_rc_mounts(self) -> list[tuple[Path, Path]]:
        """The test's rc file over each of the login user's that exists."""
        home_rc = self.folder / "home_rc"
        if not home_rc.exists():
            home_rc.write_text(f"export PATH={shlex.quote(os.environ['PATH'])}\n")
        home = Path(pwd.getpwnam(LOGIN_USER).pw_dir)
        return [(home_rc, home / name) for name in HOME_RC_FILES if (home / name).is_file()]

    def restart(self, host: Host) -> None:
        """sshd on `host` again, after a test took the host down (killed
        every process in it): the host comes back."""
        at = self.hosts.index(host)
        if self.procs[at].poll() is None:
            self.procs[at].kill()
        self.procs[at].wait()
        self.procs[at] = self._start(host, self.folder / "authorized_keys")
        self.wait_listening()

    def known_hosts_line(self, host: Host, key: Path | None = None) -> str:
        public = (key or self.host_key(host)).with_suffix(".pub").read_text().split()
        return f"{host.addr},{host.name} {public[0]} {public[1]}\n"

    def write_known_hosts(self) -> None:
        self.known_hosts.write_text("".join(self.known_hosts_line(h) for h in self.hosts))

    def write_ssh_config(self, extra: str = "") -> None:
        self.ssh_config.write_text(
            f"{extra}"
            "Host *\n"
            "  User root\n"
            f"  IdentityFile {self.client_key}\n"
            f"  UserKnownHostsFile {self.known_hosts}\n"
            "  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n"
            "  ConnectTimeout 10\n"
            "  LogLevel ERROR\n"
        )

    def wait_listening(self, timeout: float = 15.0) -> None:
        probe = (
            "import socket,sys,time\n"
            "deadline=time.time()+float(sys.argv[1])\n"
            "for addr in sys.argv[2:]:\n"
            "    while socket.socket().connect_ex((addr,22)):\n"
            "        assert time.time()<deadline, addr+' sshd not listening'\n"
            "        time.sleep(0.05)\n"
        )
        out = self.login.run([sys.executable, "-c", probe, str(timeout), *(h.addr for h in self.hosts)],
                             timeout=timeout + 10)
        if out.returncode != 0:
            raise RuntimeError(f"sshd did not come up: {out.stderr.strip()[-500:]}")

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
