"""`ddpkit doctor` on real processes: each check is provoked to fail
(missing interface, closed port, forged version mismatch, small shm, no
GPU, low memlock, full disk) and a 4-process gloo run under torchrun gives
a sane bandwidth table."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpkit.doctor.sizes import KIB
from ddpkit.launch.local import free_port
from ddpkit.shared.agreed import AGENT_MODULE
from ddpkit.shared.exitcodes import ExitCode

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CLEAN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
         "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "DDPKIT_INTERFACE", "DDPKIT_BACKEND",
         "TORCHELASTIC_USE_AGENT_STORE", "DDPKIT_FORGE_RANK_REPORT")


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith(("SLURM_", "OMPI_", "PET_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def as_rank1_of_2(port: int, **extra: str) -> dict[str, str]:
    """The environment torchrun gives rank 1 of a 2-process job, without
    torchrun: rank 0 never starts, so nothing listens on `port`."""
    return base_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


def doctor(*args: str, env: dict[str, str], torchrun: int = 0, timeout: int = 240,
           preexec: Callable[[], object] | None = None, cli: bool = False) -> tuple[int, dict, str]:
    cmd = [sys.executable]
    if cli:  # through `ddpkit doctor`, not `python -m ddpkit.doctor`
        cmd += ["-m", "ddpkit.cli", "doctor", "--json", "--disk-min=1KiB", "--shm-min=1KiB", *args]
    elif torchrun:
        cmd += ["-m", AGENT_MODULE, "--nnodes=1", f"--nproc-per-node={torchrun}",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0"]
    if not cli:
        cmd += ["-m", "ddpkit.doctor", "--json", "--disk-min=1KiB", "--shm-min=1KiB", *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec)
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON on stdout (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}") from None
    return proc.returncode, doc, proc.stderr


def rows(doc: dict, name: str) -> list[dict]:
    return [c for c in doc["checks"] if c["name"] == name or c["name"].startswith(name + " ")]


def the_failure(doc: dict, name: str) -> dict:
    fails = [c for c in rows(doc, name) if c["status"] == "FAIL"]
    assert fails, f"no FAIL for {name}: {json.dumps(doc['checks'], indent=1)}"
    assert fails[0]["fix"], "every failure names its fix"
    return fails[0]


def test_four_gloo_ranks_bandwidth_table_is_sane() -> None:
    rc, doc, err = doctor("--bench", "--max-size=256KiB", "--bench-seconds=0.02", "--ops=all_reduce,all_gather",
                          env=base_env(), torchrun=4)
    assert rc == 0, err
    assert doc["verdict"] in ("PASS", "WARN") and doc["world_size"] == 4
    # every rank's local rows reached rank 0
    assert sorted(c["rank"] for c in rows(doc, "shm")) == [0, 1, 2, 3]
    # torchrun's agent listens on every address: a warning wherever this host has a network besides loopback
    [exposure] = rows(doc, "master port exposure")
    assert exposure["rank"] == 0 and exposure["status"] in ("PASS", "WARN") and "listens on every address" in exposure["detail"]
    for op in ("all_reduce", "broadcast", "all_gather"):
        for dtype in ("float32", "float64", "int64", "float16"):
            got = rows(doc, f"{op} {dtype} (gloo)")
            assert sorted(c["rank"] for c in got) == [0, 1, 2, 3]
            assert all(c["status"] == "PASS" for c in got), got
    assert rows(doc, "rank report")[0]["status"] == "PASS"
    assert doc["barrier_us"]["gloo"] > 0
    bench = doc["bench"]
    sizes = [b["size_bytes"] for b in bench if b["op"] == "all_reduce"]
    assert sizes == [1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB]
    for b in bench:
        assert b["backend"] == "gloo" and b["iterations"] >= 1
        assert b["time_us"] > 0 and 0 < b["algbw_gbps"] < 1000
        assert b["algbw_gbps"] == pytest.approx(b["size_bytes"] / (b["time_us"] * 1e-6) / 1e9, rel=1e-6)
        factor = 2 * 3 / 4 if b["op"] == "all_reduce" else 3 / 4
        assert b["busbw_gbps"] == pytest.approx(b["algbw_gbps"] * factor, rel=1e-9)


@pytest.mark.parametrize("var", ["GLOO_SOCKET_IFNAME", "DDPKIT_INTERFACE"])
def test_missing_interface_fails_before_joining(var: str) -> None:
    rc, doc, _ = doctor(env=as_rank1_of_2(free_port(), **{var: "nonexistent0"}))
    assert rc == 1 and doc["verdict"] == "FAIL"
    fail = the_failure(doc, "interface")
    assert "nonexistent0" in fail["detail"] and "lo=127.0.0.1" in fail["fix"]
    assert not rows(doc, "master port"), "a process without its interface does not probe further"
    assert the_failure(doc, "rendezvous")["rank"] == 1


def test_closed_master_port_fails_within_the_timeout() -> None:
    port = free_port()
    rc, doc, _ = doctor("--connect-timeout=1", env=as_rank1_of_2(port))
    assert rc == 1
    fail = the_failure(doc, "master port")
    assert f"127.0.0.1:{port} did not answer within 1 s" in fail["detail"]
    assert str(port) in fail["fix"] and fail["blocking"]
    assert rows(doc, "master resolves")[0]["status"] == "PASS"


def test_unresolvable_master_fails() -> None:
    env = as_rank1_of_2(free_port())
    env["MASTER_ADDR"] = "no-such-master.invalid"
    rc, doc, _ = doctor("--connect-timeout=1", "--interface=lo", env=env)
    assert rc == 1
    assert "no-such-master.invalid" in the_failure(doc, "master resolves")["detail"]


@pytest.mark.full  # the same refusal: test_rank_report.py
def test_forged_version_mismatch_fails_the_rank_report() -> None:
    from tests.helpers.forge_rank_report import forge_env  # the forge hook is a test helper, not in ddpkit

    rc, doc, _ = doctor("--spawn=2", env=base_env(**forge_env({"on_rank": 1, "torch": "0.0-forged"})), cli=True)
    assert rc == 1 and doc["world_size"] == 2
    fail = the_failure(doc, "rank report")
    assert "versions differ" in fail["detail"] and "0.0-forged" in fail["detail"]
    # the job still ran its collectives: a doctor reports everything it can
    assert all(c["status"] == "PASS" for c in rows(doc, "all_reduce float32 (gloo)"))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount a small tmpfs")
def test_small_shm_and_full_disk_on_a_real_1m_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        rc, doc, _ = doctor(f"--shm-path={mnt}", "--shm-min=256MiB", f"--checkpoint-dir={mnt}/ckpt",
                            "--disk-min=64MiB", env=base_env())
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert rc == 1
    shm = the_failure(doc, "shm")
    assert "1 MiB size" in shm["detail"] and "--shm-size" in shm["fix"]
    assert "need 64 MiB" in the_failure(doc, "disk")["detail"]


def test_shm_threshold_is_overridable() -> None:
    total = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    too_big = f"{total // KIB + 1024}KiB"
    rc, doc, _ = doctor(f"--shm-min={too_big}", env=base_env())
    assert rc == 1 and "/dev/shm" in the_failure(doc, "shm")["detail"]
    rc, doc, _ = doctor(env=base_env())
    assert rc == 0 and rows(doc, "shm")[0]["status"] == "PASS"


def _low_memlock() -> None:
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * KIB, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has GPUs")
def test_cuda_without_gpus_fails_and_low_memlock_warns() -> None:
    rc, doc, _ = doctor("--device=cuda", env=as_rank1_of_2(free_port()), preexec=_low_memlock)
    assert rc == 1
    assert "0 GPU(s) visible" in the_failure(doc, "gpus")["detail"]
    memlock = rows(doc, "memlock")[0]
    assert memlock["status"] == "WARN" and "64 KiB" in memlock["detail"] and "unlimited" in memlock["fix"]


def test_bad_size_is_refused_with_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "ddpkit.doctor", "--max-size=12XB"], env=base_env(),
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--max-size" in proc.stderr and "64MiB" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ddpkit.doctor", "--ops=alltoall"], env=base_env(),
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "alltoall" in proc.stderr


@pytest.mark.parametrize("mode", ["one process", "--spawn=2"])
def test_wrong_interface_name_fails_before_any_group(mode: str) -> None:
    """Issue 13: one process said PASS; --spawn 2 died in gloo's traceback
    'Unable to find address for: nosuch0'."""
    args = ["--interface=nosuch0"] if mode == "one process" else ["--spawn=2"]
    env = base_env(GLOO_SOCKET_IFNAME="nosuch0") if mode != "one process" else base_env()
    rc, doc, err = doctor(*args, env=env, cli=True, timeout=60)
    assert rc == ExitCode.FAILED and doc["verdict"] == "FAIL"
    fail = the_failure(doc, "interface")
    assert "no interface nosuch0" in fail["detail"] and "lo=127.0.0.1" in fail["fix"]
    assert "Traceback" not in err and "Unable to find address" not in err


def test_master_port_in_use_fails_on_the_master() -> None:
    """Rank 0 opens the store itself (no torchrun agent): a port something
    else listens on fails before the rendezvous, with the port named."""
    with socket.socket() as squatter:
        squatter.bind(("", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = base_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        rc, doc, err = doctor("--connect-timeout=1", env=env, timeout=60)
    assert rc == ExitCode.FAILED
    fail = the_failure(doc, "master port")
    assert f"master port {port} is already in use" in fail["detail"] and "another port" in fail["fix"]
    assert "Traceback" not in err
