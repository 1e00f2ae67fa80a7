"""The `secrets:` section: environment variables every rank gets whose values
are never written into a rendered file.

One entry serves every target. Slurm, SSH, compose and the launchers take the
value by name from the environment of whoever submits or launches; Kubernetes
reads it from a Secret (`k8s: {secret, key}`, or `k8s.secret` for every entry
without one), with one `secretKeyRef` per name, so a pod gets exactly the
variables the spec lists, as every other target does (an `envFrom` of a whole
Secret would bring keys the spec never names).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

from .fields import ENV_NAME, K8sObjectName, Strict, matching

# The API server's rule for a key of a Secret's data.
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
SECRET_KEY_MAX = 253

EnvName = Annotated[str, AfterValidator(matching(
    ENV_NAME, "{value!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"))]
SecretKey = Annotated[str, AfterValidator(matching(
    SECRET_KEY, "{value!r} is not a Secret key (letters, digits, '-', '_', '.')", max_len=SECRET_KEY_MAX))]


class K8sSecretRef(Strict):
    """Where a pod reads the value: key `key` of the Secret `secret` in the
    job's namespace."""

    secret: K8sObjectName = Field(description="the Secret's name")
    key: SecretKey | None = Field(default=None, description="its key; default: the variable's name")


class Secret(Strict):
    """One secret variable."""

    name: EnvName = Field(description="the environment variable every rank gets")
    k8s: K8sSecretRef | None = Field(default=None, description="Kubernetes: the Secret and key; default: k8s.secret")


def _bare_name(data: Any) -> Any:
    return {"name": data} if isinstance(data, str) else data


# An entry as a user writes it: a bare name (`- WANDB_API_KEY`) is
# `{name: WANDB_API_KEY}`; the JSON Schema offers both forms to editors.
SecretEntry = Annotated[Secret, BeforeValidator(_bare_name, json_schema_input_type=EnvName | Secret)]


def duplicate_names(secrets: list[Secret]) -> list[str]:
    return sorted(name for name, n in Counter(s.name for s in secrets).items() if n > 1)


# ---- A value in env: that looks like a token (a warning, not an error) ---------------

_SECRET_NAME = re.compile(r"(^|_)(TOKEN|KEY|APIKEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.IGNORECASE)
# Shapes of common tokens: Hugging Face, OpenAI / Anthropic, GitHub, Slack, AWS access keys, JWTs.
_TOKEN_SHAPES = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[A-Z0-9]{16}|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)$")
_HIGH_ENTROPY_MIN_LEN = 32
_HIGH_ENTROPY_BITS = 3.5  # bits per character; English words and paths sit well below, base64/hex keys above


def _entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _looks_random(value: str) -> bool:
    """A long word of token characters, letters and digits mixed, with a high
    character entropy: an API key rather than a path, a list or a number."""
    # no '/' or '.': paths, model ids and host names are long and varied too
    return (len(value) >= _HIGH_ENTROPY_MIN_LEN and bool(re.fullmatch(r"[A-Za-z0-9_\-+=]+", value))
            and any(c.isdigit() for c in value)
            and any(c.isalpha() for c in value) and _entropy(value) >= _HIGH_ENTROPY_BITS)


def token_like_env(env: dict[str, str]) -> list[tuple[str, str]]:
    """(key, why) for every env: entry whose name or value looks like a
    credential: it is written in plain text into every rendered file."""
    out = []
    for key, value in env.items():
        if not value:
            continue
        if _SECRET_NAME.search(key):
            out.append((key, "its name says it is a credential"))
        elif _TOKEN_SHAPES.match(value):
            out.append((key, "its value has the shape of an API token"))
        elif _looks_random(value):
            out.append((key, "its value looks like a random key"))
    return out


def env_warnings(env: dict[str, str]) -> list[str]:
    """One line per token-like env: entry, for a command to print."""
    return [f"warning: env.{key}: {why}, and env: values are written in plain text into every rendered file "
            f"and launch line; move it to secrets: [{key}] (its value then comes from the environment, or a "
            "Kubernetes Secret, and is written nowhere)" for key, why in token_like_env(env)]
