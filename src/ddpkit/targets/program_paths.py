"""What a program of the user's own needs inside a container, checked when
a container target is rendered or launched: its interpreter and its script
where the spec names paths of this host, and the folders it writes its
outputs into. Each finding is one warning line naming the field and the
fix; none refuses, since an image may hold the same path as this host.

The container's view of the host is the job's mounts (compose, launch
docker, ssh.docker, Slurm with pyxis) or, on Kubernetes, the pod's volumes;
`ContainerView` holds it. Slurm with Apptainer is left out: Apptainer binds
the user's home and working directory by itself, so a host path there is
usually seen in the container.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..shared.agreed import CHECKPOINT_DIR_FLAG, RESUME_FLAG, flag_value, is_ddpkit_module
from ..spec import JobSpec

# Flags by which programs name the folder their checkpoints and outputs go to:
# ddpkit train's, Hugging Face TrainingArguments' (HfArgumentParser takes both
# spellings) and Lightning's (its Trainer's argument, and LightningCLI's).
OUTPUT_FLAGS = ("--checkpoint-dir", "--output_dir", "--output-dir", "--default_root_dir", "--default-root-dir",
                "--trainer.default_root_dir")


@dataclass(frozen=True)
class ContainerView:
    """What a container target shows the program: where it is named, the paths it
    brings in from outside the image (`seen`) and those that outlive the container
    and take writes (`kept`); `fix` words the remedy for a folder that should be kept."""

    where: str
    seen: Sequence[str]
    kept: Sequence[str]
    fix: Callable[[str], str]


def is_users_program(spec: JobSpec) -> bool:
    return not is_ddpkit_module(spec.command.module)


def under(path: str, folders: Sequence[str]) -> bool:
    p = PurePosixPath(path)
    return any(p == PurePosixPath(f) or PurePosixPath(f) in p.parents for f in folders)


def venv_of(python: str) -> Path | None:
    """The virtual environment whose interpreter `python` is, on this host, or None."""
    path = Path(python)
    if not path.is_absolute() or not path.exists():
        return None
    root = path.parent.parent
    return root if (root / "pyvenv.cfg").is_file() else None


def host_path_warnings(spec: JobSpec, view: ContainerView) -> list[str]:
    """The interpreter or script named by a path of this host that nothing brings into the container."""
    found = []
    venv = venv_of(spec.command.python)
    if venv is not None and not under(spec.command.python, view.seen):
        found.append(f"warning: {view.where}: command.python {shlex.quote(spec.command.python)} is the virtual "
                     f"environment {shlex.quote(str(venv))} of this host, which the container does not have: "
                     f"the program would not start. Fix: set command.python to the image's interpreter "
                     f"(python3), or mount the environment at the same path")
    script = spec.command.script
    if script is not None and Path(script).is_absolute() and Path(script).is_file() \
            and not under(script, view.seen):
        folder = str(PurePosixPath(script).parent)
        found.append(f"warning: {view.where}: command.script {shlex.quote(script)} is a file of this host that no "
                     f"mount brings into the container: the image must hold it at that path. Fix: add to mounts "
                     f"{shlex.quote(f'{folder}:{folder}:ro')}, or copy it into the image")
    return found


def output_warnings(spec: JobSpec, view: ContainerView) -> list[str]:
    """The output folders a program of the user's own names on its command line that
    no kept path holds: what it writes there goes when the container does."""
    if not is_users_program(spec):
        return []
    args = list(spec.command.args)
    # mounts.container_checkpoint_warning already words a resumable job's checkpoint folder.
    resumable = flag_value(args, RESUME_FLAG) == "auto"
    found = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in OUTPUT_FLAGS or (resumable and flag == CHECKPOINT_DIR_FLAG):
            continue
        folder = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if not folder or (PurePosixPath(folder).is_absolute() and under(folder, view.kept)):
            continue
        found.append(f"warning: {view.where}: {flag} {shlex.quote(folder)} is on no writable storage that "
                     f"outlives the container: what the program writes there goes with it, and a restart finds "
                     f"nothing. Fix: {view.fix(folder)}")
    return found


def program_warnings(spec: JobSpec, view: ContainerView) -> list[str]:
    return [*host_path_warnings(spec, view), *output_warnings(spec, view)]


RELATIVE = "give an absolute path (a relative one is inside the image's working directory), then "


def mount_fix(folder: str) -> str:
    """The remedy on targets that bind host folders."""
    if not PurePosixPath(folder).is_absolute():
        return RELATIVE + "add it to mounts, e.g. '/host/out:/out'"
    return f"add to mounts {shlex.quote(f'/host/out:{folder}')} (a folder every node shares, for more than one host)"


def volume_fix(folder: str) -> str:
    """The remedy on Kubernetes: a shared volume mounted at the folder."""
    if not PurePosixPath(folder).is_absolute():
        return RELATIVE + "mount a shared volume there through k8s.volumes"
    return (f"add to k8s.volumes {{name: out, mount_path: {folder}, persistent_volume_claim: <claim>}} "
            f"(a ReadWriteMany PVC or nfs)")
