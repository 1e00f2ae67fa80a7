"""A stand-in for `kubectl` on PATH, for the kubectl backend's tests (no API
server runs here): it serves the files of emulated volumes and the output of
emulated pods, as kubectl would from a cluster, and refuses what kubectl
would refuse there. Its world is a folder (FAKE_KUBECTL_DIR):

- `volumes/<claim>/`: each claim's files, as the pods that mount it see them;
- `pods/<pod>.log` and `pods/<pod>.json` (its labels, and the container's
  name): each job pod's output, as `kubectl logs` shows it;
- `created/<pod>.json`: the pods `kubectl create -f` created (claim -> mount);
- `calls.jsonl`: every command line it was given.

`cp POD:PATH DEST` copies PATH from the claim the pod mounts there, and
fails as kubectl's tar does where PATH is not on a mounted claim or is not
there: a backend that asks for the wrong path gets nothing."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import yaml

WORLD = Path(os.environ.get("FAKE_KUBECTL_DIR", "."))


def main(argv: list[str]) -> int:
    with (WORLD / "calls.jsonl").open("a") as calls:
        calls.write(json.dumps(argv) + "\n")
    words = [w for w in argv if not w.startswith("-n=")]
    if "-n" in words:
        at = words.index("-n")
        del words[at:at + 2]
    verb, rest = words[0], words[1:]
    return {"create": create, "wait": wait, "cp": cp, "delete": delete, "logs": logs}[verb](rest)


def create(rest: list[str]) -> int:
    pod = yaml.safe_load(Path(rest[rest.index("-f") + 1]).read_text())
    assert pod["kind"] == "Pod", pod
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    [container] = pod["spec"]["containers"]
    mounts = {m["mountPath"]: {"claim": claims[m["name"]]["claimName"],
                               "read_only": bool(claims[m["name"]].get("readOnly")) and bool(m.get("readOnly"))}
              for m in container["volumeMounts"] if m["name"] in claims}
    (WORLD / "created").mkdir(exist_ok=True)
    (WORLD / "created" / f"{pod['metadata']['name']}.json").write_text(json.dumps(mounts))
    print(f"pod/{pod['metadata']['name']} created")
    return 0


def _created(name: str) -> dict[str, dict[str, object]] | None:
    path = WORLD / "created" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def wait(rest: list[str]) -> int:
    [target] = [w for w in rest if w.startswith("pod/")]
    if _created(target.removeprefix("pod/")) is None:
        print(f'Error from server (NotFound): pods "{target}" not found', file=sys.stderr)
        return 1
    print(f"{target} condition met")
    return 0


def cp(rest: list[str]) -> int:
    source, dest = [w for w in rest if not w.startswith("-")]
    name, path = source.split(":", 1)
    mounts = _created(name) or {}
    for mount, what in mounts.items():
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            found = WORLD / "volumes" / str(what["claim"]) / path[len(mount):].lstrip("/")
            if found.exists():
                shutil.copytree(found, dest) if found.is_dir() else shutil.copy(found, dest)
                return 0
    print(f"tar: {path.lstrip('/')}: Cannot stat: No such file or directory", file=sys.stderr)
    return 1


def delete(rest: list[str]) -> int:
    kind, name = rest[:2]
    assert kind == "pod", rest
    path = WORLD / "created" / f"{name}.json"
    if not path.exists():
        print(f'Error from server (NotFound): pods "{name}" not found', file=sys.stderr)
        return 1
    path.rename(path.with_suffix(".deleted"))
    print(f'pod "{name}" deleted')
    return 0


def logs(rest: list[str]) -> int:
    selector = dict(term.split("=", 1) for term in rest[rest.index("-l") + 1].split(","))
    assert "--prefix" in rest and "--tail=-1" in rest, rest
    for meta in sorted((WORLD / "pods").glob("*.json")):
        pod = json.loads(meta.read_text())
        if all(pod["labels"].get(k) == v for k, v in selector.items()):
            for line in meta.with_suffix(".log").read_text().splitlines():
                print(f"[pod/{meta.stem}/{pod['container']}] {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
