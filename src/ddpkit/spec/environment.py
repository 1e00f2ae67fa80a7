"""The job's environment variables: which names the launchers own (a user
value would fight the rank contract), which settings ddpkit's job
environment writes, and the checks of `env:` and `secrets:` against them.
"""

from __future__ import annotations

from typing import Any

from ..shared import envnames
from .fields import ENV_NAME, no_nul
from .secrets import Secret, duplicate_names

# Variables the launchers own. A user value for one of these would silently
# fight the rank contract, so they are refused with the reason.
RESERVED_ENV_EXACT = frozenset(
    {
        envnames.RANK,
        envnames.LOCAL_RANK,
        envnames.WORLD_SIZE,
        envnames.LOCAL_WORLD_SIZE,
        envnames.GROUP_RANK,
        envnames.GROUP_WORLD_SIZE,
        envnames.ROLE_RANK,
        envnames.ROLE_WORLD_SIZE,
        envnames.NODE_RANK,
        envnames.NNODES,
        envnames.NPROC_PER_NODE,
        envnames.MASTER_ADDR,
        envnames.MASTER_PORT,
        envnames.JOB_COMPLETION_INDEX,
        *envnames.SOCKET_IFNAMES,
    }
)
RESERVED_ENV_PREFIXES = ("PET_", "TORCHELASTIC_", "SLURM_", "OMPI_COMM_WORLD_", "DDPKIT_")
# ddpkit's variables that are the user's to set in env: (the agent's worker start), not the launcher's.
USER_DDPKIT_ENV = frozenset({envnames.DDPKIT_AGENT_FORK, envnames.DDPKIT_AGENT_PRELOAD})
# Settings ddpkit's job environment writes (contract.target_env) unless env:
# sets them: a secret of that name would be a second, hidden value for it.
JOB_ENV_SETTINGS = frozenset(
    {
        envnames.PYTHONUNBUFFERED,
        envnames.OMP_NUM_THREADS,
        envnames.TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
        envnames.TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
        envnames.TORCH_NCCL_TRACE_BUFFER_SIZE,
        envnames.TORCH_NCCL_DUMP_ON_TIMEOUT,
        envnames.TORCH_FR_DUMP_TEMP_FILE,
    }
)


def env_numbers(value: Any) -> Any:
    """`OMP_NUM_THREADS: 4` is what a user writes: a number becomes its
    text. YAML's true/false/yes/no/on/off and null are not: which text
    was meant is unknowable, so they are refused with the fix."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, val in value.items():
        if isinstance(val, bool) or val is None:
            raise ValueError(f"{key}: YAML read this as {val!r}, not text (yes/no/on/off/true/false/null); "
                             f"quote the text you meant, e.g. {key}: \"1\"")
        out[key] = str(val) if isinstance(val, int | float) else val
    return out


def checked_env(value: dict[str, str]) -> dict[str, str]:
    """`env:` with every name a variable name the launchers leave to the user,
    and no value with a NUL."""
    for key, val in value.items():
        if not ENV_NAME.match(key):
            raise ValueError(f"{key!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if key in RESERVED_ENV_EXACT or (key.startswith(RESERVED_ENV_PREFIXES) and key not in USER_DDPKIT_ENV):
            raise ValueError(
                f"{key!r} is set by the launcher from the rank contract (nodes, nproc_per_node, "
                "master_port, network.interface); set those fields instead of the variable"
            )
        no_nul(val)
    return value


def checked_secrets(value: list[Secret]) -> list[Secret]:
    """`secrets:` with each name once, none the launchers own, none a setting
    of ddpkit's job environment."""
    twice = duplicate_names(value)
    if twice:
        raise ValueError(f"{twice} listed twice; list each secret once")
    for s in value:
        if s.name in RESERVED_ENV_EXACT or s.name.startswith(RESERVED_ENV_PREFIXES):
            raise ValueError(f"{s.name!r} is set by the launcher from the rank contract; a secret needs a "
                             "name of its own")
        if s.name in JOB_ENV_SETTINGS:
            raise ValueError(f"{s.name!r} is a setting of ddpkit's job environment, not a secret; set it "
                             "in env:")
    return value
