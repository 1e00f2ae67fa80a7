"""The `compose:` section: the Docker Compose file's network, CPUs (beyond resources:), and
whether a cuda job's file is a gloo test on CPU instead of a GPU run."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from .fields import Strict, matching

ComposeNetworkName = Annotated[str, AfterValidator(matching(
    re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$"), "{value!r} is not a compose network name"))]


class ComposeOptions(Strict):
    network: ComposeNetworkName = Field(default="ddpnet", description="compose network name")
    cpus_per_node: float | None = Field(default=None, gt=0, description=(
        "CPUs of one node's container, a fraction allowed; default: resources.cpus_per_process x nproc_per_node"))
    cpu_test: bool = Field(default=False, description=(
        "device: cuda jobs only: render the compose file as a gloo test on CPU (no GPUs reserved) instead of "
        "reserving each node's GPUs on the Docker host"))
