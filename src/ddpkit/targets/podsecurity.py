"""Which Pod Security Standard level a pod spec meets.

The rules are those of the Kubernetes documentation, "Pod Security
Standards" (https://kubernetes.io/docs/concepts/security/pod-security-standards/),
sections "Baseline" and "Restricted", as enforced by the Pod Security
admission controller for `enforce-version: latest`. Only the controls a
ddpkit manifest can touch are checked here, plus the ones a hand edit would
most likely break; each function names its control. A pod meets
`restricted` only if it also meets `baseline`; otherwise it is `privileged`
(the level that allows everything).
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Any


class Level(str, Enum):
    RESTRICTED = "restricted"
    BASELINE = "baseline"
    PRIVILEGED = "privileged"


# Baseline, "Capabilities": adding any capability beyond this list is refused.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
# Restricted, "Capabilities (v1.22+)": only this one may be added back after dropping ALL.
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Restricted, "Volume Types": only these sources.
RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
})
# Baseline and Restricted, "Seccomp": the allowed profile types (Unconfined is refused).
SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})


def _containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(key) or []


def baseline_problems(pod: dict[str, Any]) -> list[str]:
    """Violations of the Baseline policy by a pod spec (not the Pod object)."""
    problems = []
    # "Host Namespaces"
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"{field} is true")
    # "HostPath Volumes"
    problems += [f"volume {v.get('name')!r} is a hostPath" for v in pod.get("volumes") or [] if "hostPath" in v]
    pod_sc = pod.get("securityContext") or {}
    if (pod_sc.get("seccompProfile") or {}).get("type", "RuntimeDefault") not in SECCOMP_OK:
        problems.append("pod seccompProfile is Unconfined")
    for c in _containers(pod):
        sc = c.get("securityContext") or {}
        name = c.get("name")
        # "Privileged Containers"
        if sc.get("privileged"):
            problems.append(f"container {name!r} is privileged")
        # "Capabilities"
        extra = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if extra:
            problems.append(f"container {name!r} adds {sorted(extra)}")
        # "Host Ports"
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append(f"container {name!r} uses a hostPort")
        # "/proc Mount Type"
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"container {name!r} sets procMount")
        # "Seccomp"
        if (sc.get("seccompProfile") or {}).get("type", "RuntimeDefault") not in SECCOMP_OK:
            problems.append(f"container {name!r} seccompProfile is Unconfined")
    return problems


def restricted_problems(pod: dict[str, Any]) -> list[str]:
    """Violations of the Restricted policy beyond those of Baseline."""
    problems = []
    # "Volume Types"
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {v.get('name')!r} is of type {sorted(kinds)}")
    pod_sc = pod.get("securityContext") or {}
    for c in _containers(pod):
        sc = c.get("securityContext") or {}
        name = c.get("name")
        # "Privilege Escalation (v1.8+)": must be set to false explicitly.
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"container {name!r} does not set allowPrivilegeEscalation: false")
        # "Running as Non-root": container value, else the pod's, must be true.
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            problems.append(f"container {name!r} does not set runAsNonRoot: true")
        # "Running as Non-root user (v1.23+)": runAsUser must not be 0.
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"container {name!r} runs as UID 0")
        # "Seccomp (v1.19+)": RuntimeDefault or Localhost, on the container or the pod.
        profile = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if profile not in SECCOMP_OK:
            problems.append(f"container {name!r} has no RuntimeDefault/Localhost seccompProfile")
        # "Capabilities (v1.22+)": drop ALL, add back NET_BIND_SERVICE at most.
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"container {name!r} does not drop ALL capabilities")
        extra = set(caps.get("add") or []) - RESTRICTED_CAPABILITIES
        if extra:
            problems.append(f"container {name!r} adds {sorted(extra)}")
    return problems


def level(pod: dict[str, Any]) -> Level:
    """The most restrictive level the pod spec meets."""
    if baseline_problems(pod):
        return Level.PRIVILEGED
    return Level.BASELINE if restricted_problems(pod) else Level.RESTRICTED


def lowest(levels: list[Level]) -> Level:
    """The level a file of several pods meets: the least restrictive of them."""
    order = list(Level)
    return max(levels, key=order.index, default=Level.RESTRICTED)
