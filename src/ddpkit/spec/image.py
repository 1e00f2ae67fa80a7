"""Container images in the syntax of each Slurm container runtime.

A job names its image once, as Docker does (`ghcr.io/org/img:tag`); pyxis
(enroot) and apptainer each spell it their own way. The spec refuses an image
a runtime cannot express (exit 2) and targets/slurm writes the translation.
"""

from __future__ import annotations

import re

# Docker's rule for the first component of a reference: a registry host when
# it has a dot or a port, or is localhost; otherwise a Docker Hub repository.
DOCKER_HUB_HOSTS = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
# enroot's own parser (src/docker.sh, docker::import): docker://[USER@][REGISTRY#]IMAGE[:TAG]
ENROOT_URI = re.compile(r"^(?:[A-Za-z0-9_.!~*'()%;:&=+$,@-]+@)?(?:[^#]+#)?[a-z0-9/._-]+(?::[A-Za-z0-9._:-]+)?$")
# Schemes apptainer pulls from, and the local forms it opens (`apptainer help build`).
APPTAINER_SCHEME = re.compile(r"^(docker|library|oras|shub|http|https)://|^(docker-archive|docker-daemon|oci|oci-archive):")
ENROOT_SCHEMES = ("dockerd://", "podman://")
SQUASHFS_SUFFIXES = (".sqsh", ".sqfs", ".squashfs")


def _is_local_path(image: str) -> bool:
    return image.startswith(("/", "./", "../"))


def _split_registry(ref: str) -> tuple[str | None, str]:
    """(registry, rest) of a Docker reference; registry None for Docker Hub."""
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return (None if first in DOCKER_HUB_HOSTS else first), rest
    return None, ref


def enroot_image(image: str) -> str:
    """The image as pyxis' --container-image takes it: an enroot URI
    `[USER@][REGISTRY#]IMAGE[:TAG]` without its docker:// scheme, or a
    squashfs path. `ghcr.io/org/img:tag` -> `ghcr.io#org/img:tag`; Docker Hub
    images lose the host (enroot's default registry is Docker Hub, and it adds
    `library/` to one-word names itself). Raises ValueError with the fix."""
    if _is_local_path(image):
        if image.endswith(".sif"):
            raise ValueError(f"{image!r} is an Apptainer image; pyxis runs squashfs files ({', '.join(SQUASHFS_SUFFIXES)})")
        return image
    if image.endswith(SQUASHFS_SUFFIXES + (".sif",)):
        raise ValueError(f"{image!r}: write a local image as an absolute path or ./relative path "
                         "(pyxis reads any other word as a registry image)")
    if image.startswith(ENROOT_SCHEMES):
        return image
    ref = image.removeprefix("docker://")
    if "://" in ref:
        raise ValueError(f"{image!r}: pyxis/enroot pull docker:// images only (or dockerd://, podman://)")
    if "@sha256:" in ref or "@" in ref.split("#")[-1]:
        raise ValueError(f"{image!r}: enroot's image URI has no digest form; use a tag, or import the image "
                         "to a squashfs file and give its path")
    if "#" not in ref:
        registry, rest = _split_registry(ref)
        ref = f"{registry}#{rest}" if registry else rest
    if not ENROOT_URI.match(ref):
        raise ValueError(f"{image!r} does not fit enroot's [USER@][REGISTRY#]IMAGE[:TAG] "
                         "(the image name is lower-case letters, digits and / . _ -)")
    return ref


def apptainer_image(image: str) -> str:
    """The image as `apptainer exec` takes it: a URI with its scheme
    (`docker://ghcr.io/org/img:tag`), or a local file passed unchanged. An
    enroot-style `REGISTRY#IMAGE` is turned back into a Docker reference."""
    if _is_local_path(image) or APPTAINER_SCHEME.match(image):
        return image
    if image.endswith((".sif", *SQUASHFS_SUFFIXES)):
        raise ValueError(f"{image!r}: write a local image as an absolute path or ./relative path "
                         "(apptainer needs a scheme such as docker:// for anything else)")
    if "://" in image:
        raise ValueError(f"{image!r}: apptainer cannot pull this scheme; use docker://, oras:// or library://")
    registry, sep, rest = image.rpartition("#")
    if sep:
        registry = registry.rpartition("@")[2]  # enroot's USER@: apptainer takes credentials from the environment
        return f"docker://{registry}/{rest}"
    return f"docker://{image}"


def container_image(image: str, runtime: str) -> str:
    """`image` written in the syntax of the Slurm container runtime."""
    if runtime == "pyxis":
        return enroot_image(image)
    if runtime == "apptainer":
        return apptainer_image(image)
    return image
