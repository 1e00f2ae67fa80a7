"""SSH host keys as OpenSSH checks them: StrictHostKeyChecking and
UserKnownHostsFile from ssh_config (the policy table, as units), then the
same options against a real sshd on a namespace host."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from ddpkit.launch.ssh.hostkeys import Action, Checking, KeyState, changed_fix, policy_from, unknown_fix
from tests.infra import netns, sshd
from tests.infra.shared import SshPool


def options(text: str, host: str = "h") -> paramiko.SSHConfigDict:
    return paramiko.SSHConfig.from_text(text).lookup(host)


@pytest.mark.parametrize(("value", "checking"), [
    (None, Checking.YES),  # OpenSSH's default is ask: nobody can answer, so refuse
    ("ask", Checking.YES), ("yes", Checking.YES), ("accept-new", Checking.ACCEPT_NEW),
    ("no", Checking.NO), ("off", Checking.NO), ("No", Checking.NO),
])
def test_strict_host_key_checking_values(value: str | None, checking: Checking) -> None:
    text = f"Host *\n  StrictHostKeyChecking {value}\n" if value else ""
    assert policy_from(options(text)).checking is checking


# (StrictHostKeyChecking, state of the host's key) -> what the launcher does, with a real known_hosts file.
TABLE = [
    ("yes", KeyState.KNOWN, Action.CONNECT), ("yes", KeyState.UNKNOWN, Action.REFUSE),
    ("yes", KeyState.CHANGED, Action.REFUSE),
    ("accept-new", KeyState.KNOWN, Action.CONNECT), ("accept-new", KeyState.UNKNOWN, Action.RECORD),
    ("accept-new", KeyState.CHANGED, Action.REFUSE),
    ("no", KeyState.KNOWN, Action.CONNECT), ("no", KeyState.UNKNOWN, Action.WARN),
    ("no", KeyState.CHANGED, Action.WARN),
]


@pytest.mark.parametrize(("value", "state", "action"), TABLE)
def test_policy_table(value: str, state: KeyState, action: Action) -> None:
    policy = policy_from(options(f"Host *\n  StrictHostKeyChecking {value}\n  UserKnownHostsFile /k/a /k/b\n"))
    assert policy.action(state) is action


def test_known_hosts_files_all_read_first_written() -> None:
    policy = policy_from(options("Host *\n  UserKnownHostsFile ~/k1 /etc/k2\n"))
    assert policy.files == (Path("~/k1").expanduser(), Path("/etc/k2"))
    assert policy.record_to == Path("~/k1").expanduser()
    assert policy_from(options("")).files == (Path("~/.ssh/known_hosts").expanduser(),)


@pytest.mark.parametrize("nowhere", ["/dev/null", "none"])
def test_dev_null_keeps_nothing_and_accept_new_still_connects(nowhere: str) -> None:
    policy = policy_from(options(f"Host *\n  StrictHostKeyChecking accept-new\n  UserKnownHostsFile {nowhere}\n"))
    assert policy.files == () and policy.record_to is None
    assert policy.action(KeyState.UNKNOWN) is Action.CONNECT


def test_flags_win_over_the_config_but_never_lower_no() -> None:
    config = options("Host *\n  StrictHostKeyChecking yes\n  UserKnownHostsFile /dev/null\n")
    policy = policy_from(config, known_hosts=Path("/tmp/kh"), accept_new=True)
    assert (policy.checking, policy.files) == (Checking.ACCEPT_NEW, (Path("/tmp/kh"),))
    assert policy_from(options("Host *\n  StrictHostKeyChecking no\n"), accept_new=True).checking is Checking.NO


def test_the_config_applies_per_host() -> None:
    text = "Host inside-*\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\nHost *\n  StrictHostKeyChecking yes\n"
    assert policy_from(options(text, "inside-3")).checking is Checking.NO
    assert policy_from(options(text, "outside")).checking is Checking.YES


def test_no_fix_appends_to_dev_null() -> None:
    """The refusal's fix must be one that can work: with /dev/null as the
    known-hosts file, `ssh-keyscan >> /dev/null` would change nothing."""
    nowhere = policy_from(options("Host *\n  UserKnownHostsFile /dev/null\n"))
    fix = unknown_fix(nowhere, "10.0.0.5", 22)
    assert ">> /dev/null" not in fix and "--known-hosts" in fix and "accept-new" in fix
    real = policy_from(options("Host *\n  UserKnownHostsFile /k/hosts\n"))
    assert unknown_fix(real, "10.0.0.5", 2222) == ("check it, then run: ssh-keyscan -p 2222 10.0.0.5 >> /k/hosts   "
                                                   "(or pass --accept-new-host-keys)")
    assert "ssh-keygen -f /k/hosts -R 10.0.0.5" in changed_fix(real, "10.0.0.5")


# ---- a real sshd on a namespace host ------------------------------------------------

_REASON = netns.available() or sshd.available()

# Connects the way the launcher does and says how it went (stdout) and what it warned (stderr).
PROBE = """\
import sys
from pathlib import Path
from ddpkit.launch.ssh.connect import ConnectError, SshSettings, connect, close, resolve
s = SshSettings(config_path=Path(sys.argv[1]), timeout_s=10)
try:
    c = connect(resolve(sys.argv[2], s), s)
except ConnectError as exc:
    print("REFUSED", exc.kind, "|", exc)
else:
    _, out, _ = c.exec_command("hostname")
    print("CONNECTED", out.read().decode().strip())
    close(c)
"""


@pytest.fixture(scope="module")
def one_host(ssh_pool: SshPool) -> Iterator[tuple[netns.Network, sshd.SshHosts]]:
    with ssh_pool.lease() as hosts:  # the worker's sshd hosts: this module uses login and node1
        yield hosts


def _probe(net: netns.Network, hosts: sshd.SshHosts, folder: Path, config: str) -> tuple[str, str]:
    path = folder / "ssh_config"
    path.write_text(f"Host node\n  HostName {net['node1'].addr}\n  User root\n"
                    f"  IdentityFile {hosts.client_key}\n{config}")
    out = net["login"].run([sys.executable, "-c", PROBE, str(path), "node"], timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr.strip()


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
def test_real_sshd_honours_the_config(one_host: tuple[netns.Network, sshd.SshHosts], tmp_path: Path) -> None:
    net, hosts = one_host
    addr = net["node1"].addr
    # Common inside clusters: no checking, nothing kept. Connects, with one warning line.
    out, err = _probe(net, hosts, tmp_path, "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n")
    assert out == "CONNECTED node1", err
    assert len(err.splitlines()) == 1 and "StrictHostKeyChecking no" in err and "not verified" in err, err
    # Nothing said: an unknown key is refused, with a fix that can work.
    out, err = _probe(net, hosts, tmp_path, "  UserKnownHostsFile /dev/null\n")
    assert out.startswith("REFUSED host key unknown"), out + err
    assert ">> /dev/null" not in out and "--known-hosts" in out
    # accept-new records the key in the first file and connects; the second file is read too.
    first, second = tmp_path / "kh1", tmp_path / "kh2"
    out, err = _probe(net, hosts, tmp_path, f"  StrictHostKeyChecking accept-new\n  UserKnownHostsFile {first} {second}\n")
    assert out == "CONNECTED node1" and err == "", out + err
    key = hosts.host_key(net["node1"]).with_suffix(".pub").read_text().split()
    assert first.read_text() == f"{addr} {key[0]} {key[1]}\n" and not second.exists()
    # A changed key: refused under accept-new, connected with a warning under no.
    forged = sshd.keygen(tmp_path / "forged").with_suffix(".pub").read_text().split()
    second.write_text(f"{addr} {forged[0]} {forged[1]}\n")
    first.unlink()
    out, err = _probe(net, hosts, tmp_path, f"  StrictHostKeyChecking accept-new\n  UserKnownHostsFile {first} {second}\n")
    assert out.startswith("REFUSED host key changed") and f"ssh-keygen -f {second} -R {addr}" in out, out + err
    out, err = _probe(net, hosts, tmp_path, f"  StrictHostKeyChecking no\n  UserKnownHostsFile {second}\n")
    assert out == "CONNECTED node1" and "CHANGED" in err and len(err.splitlines()) == 1, out + err
    assert second.read_text() == f"{addr} {forged[0]} {forged[1]}\n"  # a changed key is never overwritten
