"""The `compose:` section: the Docker Compose file's network and CPUs."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from .fields import Strict, matching

ComposeNetworkName = Annotated[str, AfterValidator(matching(
    re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$"), "{value!r} is not a compose network name"))]


class ComposeOptions(Strict):
    network: ComposeNetworkName = Field(default="ddpnet", description="compose network name")
    cpus_per_node: float | None = Field(default=None, gt=0)
