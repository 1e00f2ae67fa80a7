"""Opening verified SSH connections with paramiko, the way `ssh` would.

~/.ssh/config is honoured (Host, HostName, User, Port, IdentityFile,
ProxyJump, UserKnownHostsFile, StrictHostKeyChecking); host keys are checked
as OpenSSH checks them (see hostkeys): by default an unknown or changed key
is refused with the command that fixes it. Errors are `ConnectError`s whose
text is the one line a person needs.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from .hostfile import HostEntry, parse_host
from .hostkeys import Action, Checking, HostKeyPolicy, KeyState, changed_fix, policy_from, unknown_fix

DEFAULT_CONFIG = Path("~/.ssh/config")
# What a session on a host that dropped or was cut off raises: paramiko
# raises EOFError, not an SSHException, when the transport dies under a call.
SSH_ERRORS = (OSError, EOFError, paramiko.SSHException)
# paramiko's transport thread logs a failed handshake (a host that resets the
# connection while it boots) as a traceback, which Python's last-resort
# handler prints; connect() already turns the failure into a ConnectError.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


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

    def host_key_policy(self, alias: str) -> HostKeyPolicy:
        return policy_from(self.config.lookup(alias), known_hosts=self.known_hosts,
                           accept_new=self.accept_new_host_keys)


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


def _key_state(known: paramiko.HostKeys, name: str, key: paramiko.PKey) -> KeyState:
    entry = known.lookup(name)
    if entry is None:
        return KeyState.UNKNOWN
    return KeyState.KNOWN if entry.get(key.get_name()) == key else KeyState.CHANGED


class _VerifyPolicy(paramiko.MissingHostKeyPolicy):
    """Called for every key paramiko's client does not know; decides with
    the host's HostKeyPolicy (with `no`, the client knows no key, so a
    changed key comes here too and only earns a warning)."""

    def __init__(self, endpoint: Endpoint, settings: SshSettings, policy: HostKeyPolicy, known: paramiko.HostKeys):
        self.endpoint, self.settings, self.policy, self.known = endpoint, settings, policy, known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        state = _key_state(self.known, self.endpoint.known_hosts_name, key)
        action = self.policy.action(state)
        if action is Action.REFUSE:
            raise ConnectError(
                "host key unknown",
                f"{self.endpoint}: host key unknown ({key.get_name()}); "
                f"{unknown_fix(self.policy, self.endpoint.hostname, self.endpoint.port)}",
            )
        if action is Action.WARN:
            what = "CHANGED, possible man-in-the-middle" if state is KeyState.CHANGED else "not verified"
            print(f"ddpkit: warning: {self.endpoint}: host key {key.get_name()} {key.fingerprint} {what}; "
                  "connecting because ssh_config says StrictHostKeyChecking no", file=sys.stderr, flush=True)
        if state is KeyState.UNKNOWN and action is not Action.CONNECT:
            self._record(key)

    def _record(self, key: paramiko.PKey) -> None:
        path = self.policy.record_to
        if path is None:  # /dev/null: nothing is kept, as with ssh
            return
        with self.settings._lock:  # several hosts may add keys at once
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as out:
                out.write(f"{self.endpoint.known_hosts_name} {key.get_name()} {key.get_base64()}\n")


def _known_keys(policy: HostKeyPolicy) -> paramiko.HostKeys:
    """Every key in the policy's files (ssh reads them all)."""
    known = paramiko.HostKeys()
    for path in policy.files:
        if path.is_file():
            known.load(str(path))
    return known


def _open_socket(endpoint: Endpoint, settings: SshSettings,
                 opened: list[paramiko.SSHClient]) -> paramiko.Channel | None:
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


def connect(endpoint: Endpoint, settings: SshSettings, *, _opened: list[paramiko.SSHClient] | None = None) -> paramiko.SSHClient:
    """A connected, host-key-verified client (jump hosts stay open with it)."""
    opened: list[paramiko.SSHClient] = [] if _opened is None else _opened
    policy = settings.host_key_policy(endpoint.alias)
    known = _known_keys(policy)
    client = paramiko.SSHClient()
    if policy.checking is not Checking.NO:  # paramiko then refuses a changed key itself
        for name, keys in known.items():
            for key_type, key in keys.items():
                client.get_host_keys().add(name, key_type, key)
    client.set_missing_host_key_policy(_VerifyPolicy(endpoint, settings, policy, known))
    try:
        sock = _open_socket(endpoint, settings, opened)
        client.connect(
            endpoint.hostname, port=endpoint.port, username=endpoint.user,
            # paramiko takes a list here too (its stubs say str only)
            key_filename=list(endpoint.identity_files) or None,  # type: ignore[arg-type]
            timeout=settings.timeout_s,
            banner_timeout=settings.timeout_s, auth_timeout=settings.timeout_s, sock=sock,
        )
    except ConnectError:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise ConnectError(
            "host key changed",
            f"{endpoint}: host key CHANGED ({exc.key.get_name()}), possible man-in-the-middle; "
            f"{changed_fix(policy, endpoint.known_hosts_name)}",
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise ConnectError(
            "auth refused",
            f"{endpoint}: authentication refused ({exc}); add your public key on the host "
            f"(ssh-copy-id -p {endpoint.port} {shlex.quote(endpoint.user + '@' + endpoint.hostname)}) "
            "or pass -i KEY / set IdentityFile",
        ) from None
    except socket.gaierror as exc:  # before OSError: no port or sshd question when the name has no address
        client.close()
        raise ConnectError(
            "unknown host",
            f"{endpoint}: {endpoint.hostname!r} does not resolve ({exc.strerror}); check the spelling, or give "
            "its address, or a HostName for it in ~/.ssh/config",
        ) from None
    except SSH_ERRORS as exc:  # TimeoutError is an OSError
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
