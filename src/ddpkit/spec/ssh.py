"""The `ssh:` section: the hosts and the connection of `launch ssh` and the
rendered SSH launcher."""

from __future__ import annotations

from pydantic import Field, field_validator

from .fields import Strict


class SshOptions(Strict):
    hosts: list[str] = Field(default_factory=list, description="hosts in node-rank order (or use --hostfile)")
    user: str | None = None
    port: int = Field(default=22, ge=1, le=65535)
    workdir: str | None = Field(default=None, description="directory to cd into on every host")
    docker: bool = Field(default=False, description="run inside `docker run --gpus all --network host --ipc host IMAGE`")
    log_dir: str = Field(default="logs", description="local folder for one log file per node")
    connect_timeout_s: float = Field(default=10.0, gt=0)
    grace_s: float = Field(default=5.0, ge=0, description="SIGTERM to SIGKILL grace period on teardown")
    # As ssh's ServerAliveInterval/ServerAliveCountMax: a host that stops
    # answering (power loss, partition) sends no reset, so without this the
    # launcher and the other ranks would wait for it for good.
    alive_interval_s: float = Field(default=5.0, gt=0, description="seconds between keep-alive requests to each host")
    alive_count: int = Field(default=3, ge=1, description="keep-alive requests left unanswered after which the host's "
                             "connection is closed: its node ends without an exit status")

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        for h in value:
            if not h or any(c.isspace() for c in h) or h.startswith("-"):
                raise ValueError(f"{h!r} is not a host: no whitespace, no leading '-'")
        if len(set(value)) != len(value):
            raise ValueError("a host appears twice; each node needs its own host")
        return value
