"""Opening verified SSH connections with paramiko, the way `ssh` would.

~/.ssh/config is honoured (Host, HostName, User, Port, IdentityFile,
ProxyJump, UserKnownHostsFile); host keys are checked against known_hosts and
an unknown or changed key is refused with the command that fixes it, unless
the user explicitly accepts new keys. Errors are `ConnectError`s whose text is
the one line a person needs.
"""

from __future__ import annotations

import os
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from .hostfile import HostEntry, parse_host

DEFAULT_CONFIG = Path("~/.ssh/config")
DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")


class ConnectError(Exception):
    """A host cannot be used; the message says what to do about it."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Endpoint:
    """Where to connect after ~/.ssh/config is applied."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...] = ()
    jump: Endpoint | None = None

    @property
    def known_hosts_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def __str__(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


@dataclass
class SshSettings:
    """What every connection of one launch shares."""

    config_path: Path | None = None
    known_hosts: Path | None = None
    identity: Path | None = None
    accept_new_host_keys: bool = False
    timeout_s: float = 10.0
    default_user: str | None = None
    default_port: int = 22
    alive_interval_s: float = 5.0
    alive_count: int = 3
    _config: paramiko.SSHConfig | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def config(self) -> paramiko.SSHConfig:
        if self._config is None:
            path = (self.config_path or DEFAULT_CONFIG).expanduser()
            self._config = paramiko.SSHConfig.from_path(str(path)) if path.is_file() else paramiko.SSHConfig()
        return self._config

    def known_hosts_path(self, options: dict) -> Path:
        if self.known_hosts is not None:
            return self.known_hosts.expanduser()
        configured = options.get("userknownhostsfile")
        return Path(configured.split()[0] if configured else DEFAULT_KNOWN_HOSTS).expanduser()


def _local_user() -> str:
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "root"


def resolve(alias: str, settings: SshSettings, *, user: str | None = None, port: int | None = None,
            depth: int = 0) -> Endpoint:
    """Apply ssh_config to one host: explicit user/port win over the config,
    the config wins over the job's defaults (as with `ssh -p`, `user@`)."""
    if depth > 8:
        raise ConnectError("config", f"{alias}: ProxyJump chain is longer than 8 hops (a loop in ssh config?)")
    options = settings.config.lookup(alias)
    identity = [str(settings.identity)] if settings.identity else []
    identity += [os.path.expanduser(p) for p in options.get("identityfile", [])]
    jump = None
    if options.get("proxyjump", "none").lower() != "none":
        first_hop = options["proxyjump"].split(",")[0]
        entry = _parse_jump(first_hop)
        jump = resolve(entry.host, settings, user=entry.user, port=entry.port, depth=depth + 1)
    return Endpoint(
        alias=alias,
        hostname=options.get("hostname", alias),
        port=int(port or options.get("port") or settings.default_port),
        user=user or options.get("user") or settings.default_user or _local_user(),
        identity_files=tuple(identity),
        jump=jump,
    )


def _parse_jump(text: str) -> HostEntry:
    return parse_host(text.removeprefix("ssh://"), "ProxyJump")


def endpoint_for(entry: HostEntry, settings: SshSettings) -> Endpoint:
    return resolve(entry.host, settings, user=entry.user, port=entry.port)


class _VerifyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown key: refuse with the fix, or record it when the user asked."""

    def __init__(self, endpoint: Endpoint, settings: SshSettings, path: Path):
        self.endpoint, self.settings, self.path = endpoint, settings, path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.settings.accept_new_host_keys:
            raise ConnectError(
                "host key unknown",
                f"{self.endpoint}: host key unknown ({key.get_name()}); check it, then run: "
                f"ssh-keyscan -p {self.endpoint.port} {shlex.quote(self.endpoint.hostname)} >> "
                f"{shlex.quote(str(self.path))}   (or pass --accept-new-host-keys)",
            )
        with self.settings._lock:  # several hosts may add keys at once
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(f"{self.endpoint.known_hosts_name} {key.get_name()} {key.get_base64()}\n")


def _open_socket(endpoint: Endpoint, settings: SshSettings, opened: list[paramiko.SSHClient]) -> object:
    if endpoint.jump is None:
        return None
    jump_client = connect(endpoint.jump, settings, _opened=opened)
    transport = jump_client.get_transport()
    assert transport is not None
    try:
        return transport.open_channel("direct-tcpip", (endpoint.hostname, endpoint.port), ("127.0.0.1", 0),
                                      timeout=settings.timeout_s)
    except (paramiko.SSHException, OSError) as exc:
        raise ConnectError("unreachable", f"{endpoint}: jump host {endpoint.jump} cannot reach it ({exc})") from None


def connect(endpoint: Endpoint, settings: SshSettings, *, _opened: list | None = None) -> paramiko.SSHClient:
    """A connected, host-key-verified client (jump hosts stay open with it)."""
    opened: list[paramiko.SSHClient] = [] if _opened is None else _opened
    options = settings.config.lookup(endpoint.alias)
    path = settings.known_hosts_path(options)
    client = paramiko.SSHClient()
    if path.is_file():
        client.load_host_keys(str(path))
    client.set_missing_host_key_policy(_VerifyPolicy(endpoint, settings, path))
    try:
        sock = _open_socket(endpoint, settings, opened)
        client.connect(
            endpoint.hostname, port=endpoint.port, username=endpoint.user,
            key_filename=list(endpoint.identity_files) or None, timeout=settings.timeout_s,
            banner_timeout=settings.timeout_s, auth_timeout=settings.timeout_s, sock=sock,
        )
    except ConnectError:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise ConnectError(
            "host key changed",
            f"{endpoint}: host key CHANGED ({exc.key.get_name()}), possible man-in-the-middle; if the host was "
            f"reinstalled, run: ssh-keygen -f {shlex.quote(str(path))} -R "
            f"{shlex.quote(endpoint.known_hosts_name)}  and add the new key",
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise ConnectError(
            "auth refused",
            f"{endpoint}: authentication refused ({exc}); add your public key on the host "
            f"(ssh-copy-id -p {endpoint.port} {shlex.quote(endpoint.user + '@' + endpoint.hostname)}) "
            "or pass -i KEY / set IdentityFile",
        ) from None
    except (TimeoutError, OSError, paramiko.SSHException, EOFError) as exc:
        client.close()
        raise ConnectError(
            "unreachable",
            f"{endpoint}: unreachable ({str(exc) or type(exc).__name__}); check the address and that sshd "
            "listens on that port",
        ) from None
    client._ddpkit_jumps = opened  # type: ignore[attr-defined]  # keep jump hosts alive with the client
    opened.append(client)
    return client


def close(client: paramiko.SSHClient) -> None:
    for other in reversed(getattr(client, "_ddpkit_jumps", [client])):
        other.close()
