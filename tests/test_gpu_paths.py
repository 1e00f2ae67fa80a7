"""The CUDA-only paths of the trainer, each on a real GPU (marker `gpu`: the
suite skips them without one, tests/conftest.py), and beside each the CPU
test of the same logic where one is possible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.agent.zygote import NVML_CHECK
from ddpkit.train.checkpoint import files as checkpoint_files
from ddpkit.train.config.values import TrainConfig
from ddpkit.train.model.balanced_dp import BalancedDataParallel
from ddpkit.train.model.build import build_model
from ddpkit.train.model.strategy import parallelise, process_devices
from ddpkit.train.startup.rank_report import versions
from tests.helpers.runs import ROOT, TINY

RESNET = ["--model", "resnet18", "--image-size", "16", "--workers", "0", "--progress", "plain"]
SMALL = ["--synthetic-size", "32", "--batch-size", "8", "--eval-size", "16", "--epochs", "1"]


# How a whole run starts: `ddpkit train --spawn` (torch.multiprocessing), and the
# per-node line every target renders, `python -m ddpkit.agent`, with its workers
# forked from the zygote and, DDPKIT_AGENT_FORK=0, as new interpreters.
LAUNCHERS = ("spawn", "agent", "agent-nofork")
# A forked worker's imports phase is the modules its zygote had not imported (0.02 s
# on the 2-core CI machine); a new interpreter imports torch (about 2 s there).
FORKED_IMPORTS_S, INTERPRETER_IMPORTS_S = 0.5, 0.5


def launch_line(launcher: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command that runs `ddpkit train ARGV` (one process) under `launcher`, and its environment additions."""
    if launcher == "spawn":
        return [sys.executable, "-m", "ddpkit.cli", "train", "--spawn", "1", *argv], {}
    agent = [sys.executable, "-m", "ddpkit.agent", "--standalone", "--nnodes=1", "--nproc-per-node=1",
             "--max-restarts=0", "-m", "ddpkit.train", *argv]
    return agent, {"DDPKIT_AGENT_FORK": "0" if launcher == "agent-nofork" else "1"}


def train(tmp_path: Path, *argv: str, launcher: str = "spawn") -> dict[str, Any]:
    """Run `ddpkit train` to completion in a fresh process; its summary record
    (of this run: rank 0 appends to --metrics, and a resumed run shares the file).
    Under the agent, the worker's start-up record shows how it started."""
    metrics = tmp_path / "metrics.jsonl"
    start = metrics.stat().st_size if metrics.exists() else 0
    command, extra_env = launch_line(launcher, [*argv, *SMALL, "--metrics", str(metrics)])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1", **extra_env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        env.pop(name, None)
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "new interpreters" not in done.stderr  # the agent forked (or was told not to)
    records = [json.loads(line) for line in metrics.read_bytes()[start:].decode().splitlines()]
    [summary] = [r for r in records if r["kind"] == "summary"]
    assert summary["status"] == "finished"
    if launcher != "spawn":
        [startup] = [r for r in records if r["kind"] == "startup"]
        imports = startup["phases"]["imports"]
        assert imports < FORKED_IMPORTS_S if launcher == "agent" else imports > INTERPRETER_IMPORTS_S, startup
    return summary


# ---- whole runs on one GPU: DDP over NCCL and DataParallel, under each launcher ----

@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize(
    "extra",
    [
        [],  # DDP with device_ids=[cuda:0] over NCCL
        ["--precision", "fp16"],  # GradScaler on CUDA
        ["--precision", "bf16", "--channels-last", "--sync-bn"],  # SyncBatchNorm needs CUDA
        ["--gpu-resident-data"],  # the data set lives on the GPU
        ["--compile"],  # torch.compile under DDP
    ],
    ids=["nccl", "fp16-gradscaler", "bf16-syncbn", "gpu-resident-data", "compile"],
)
def test_one_gpu_ddp_over_nccl_trains(tmp_path: Path, extra: list[str], launcher: str) -> None:
    summary = train(tmp_path, "--device", "cuda", "--backend", "nccl", "--interface", "lo", *RESNET, *extra,
                    launcher=launcher)
    assert summary["world_size"] == 1


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("extra", [[], ["--gpu0-batch", "2"]], ids=["dataparallel", "balanced"])
def test_dataparallel_over_every_visible_gpu_trains(tmp_path: Path, extra: list[str], launcher: str) -> None:
    train(tmp_path, "--strategy", "dp", "--device", "cuda", *TINY, *extra, launcher=launcher)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_checkpoint_resumes_onto_the_gpu(tmp_path: Path, launcher: str) -> None:
    common = ["--device", "cuda", "--backend", "nccl", "--interface", "lo", *TINY,
              "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    train(tmp_path, *common, "--max-steps", "2", launcher=launcher)
    summary = train(tmp_path, *common, "--resume", "auto", launcher=launcher)
    assert summary["world_size"] == 1


@pytest.mark.gpu
@pytest.mark.slow
def test_a_preload_that_asks_for_gpus_leaves_forked_workers_able_to_use_them(tmp_path: Path) -> None:
    """A module the zygote preloads that asks torch.cuda.is_available() while imported (libraries
    do): with NVML there, the question does not touch the CUDA runtime, so the workers are still
    forked; either way the worker computes on the GPU."""
    (tmp_path / "asks_for_gpus.py").write_text("import torch\nassert torch.cuda.is_available()\n")
    (tmp_path / "worker.py").write_text(
        "import sys, torch\nprint('preloaded', 'asks_for_gpus' in sys.modules)\n"
        "print('sum', float(torch.ones(1000, device='cuda').sum()))\n")
    argv = [sys.executable, "-m", "ddpkit.agent", "--standalone", "--nnodes=1", "--nproc-per-node=1",
            "--max-restarts=0", "worker.py"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "DDPKIT_AGENT_PRELOAD": "asks_for_gpus"}
    env.pop(NVML_CHECK, None)
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sum 1000.0" in done.stdout
    forked = "new interpreters" not in done.stderr
    assert f"preloaded {forked}" in done.stdout, (done.stdout, done.stderr[-2000:])


# ---- in-process: the pieces a run uses ----

@pytest.mark.gpu
def test_balanced_dataparallel_matches_the_module_on_the_gpus() -> None:
    torch.manual_seed(0)
    module = nn.Linear(6, 3).cuda()
    x = torch.randn(10, 6, device="cuda")
    wrapped = BalancedDataParallel(2, module)
    torch.testing.assert_close(wrapped(x), module(x))


@pytest.mark.parametrize("gpu0_batch", [None, 2], ids=["dataparallel", "balanced"])
def test_dataparallel_of_a_cpu_process_runs_the_module_as_is(gpu0_batch: int | None) -> None:
    """`--strategy dp --device cpu`, on a host with GPUs too: torch's DataParallel would refuse a
    module left on the CPU there (and index an empty device list), so a CPU process gets the module."""
    torch.manual_seed(0)
    model = build_model("tiny", 10, 8)
    config = TrainConfig(strategy="dp", gpu0_batch=gpu0_batch)
    par = parallelise(model, config, torch.device("cpu"), 0, 1, False)
    assert par.module is model and par.input_device == torch.device("cpu")
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(par.module(x), model(x))


@pytest.mark.gpu
def test_gradscaler_fp16_step_updates_the_weights() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2).cuda()
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A small initial scale: at the default 2**16 the fp16 weight gradient of
    # this layer can overflow, and the scaler then rightly skips the step and
    # halves its scale (seen on an H200: 32768.0 after the step, weights unchanged).
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(4, 8, device="cuda")).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**10, "no overflow: the step was taken, the scale kept"
    assert not torch.equal(before, model.weight.detach())


def test_a_disabled_gradscaler_is_a_plain_step_on_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # what the loop builds for fp32/bf16
    loss = model(torch.randn(4, 8)).pow(2).mean()
    assert scaler.scale(loss) is loss  # disabled: no scaling at all
    loss.backward()
    want = [p.detach() - 0.1 * p.grad for p in model.parameters() if p.grad is not None]
    scaler.step(opt)
    for got, w in zip(model.parameters(), want):
        torch.testing.assert_close(got.detach(), w)


def _rng_roundtrip(tmp_path: Path, device: torch.device) -> None:
    """Saved RNG state, read back with map_location onto `device`, replays the same draws."""
    torch.manual_seed(1)
    path = tmp_path / "rng.pt"
    torch.save({"rng": checkpoint_files.rng_state(device)}, path)
    first = torch.rand(4, device=device)
    state = checkpoint_files.read_checkpoint(path, map_location=device)
    checkpoint_files.set_rng_state(state["rng"], device)
    torch.testing.assert_close(torch.rand(4, device=device), first)
    assert ("cuda" in state["rng"]) == (device.type == "cuda")


@pytest.mark.gpu
def test_cuda_rng_state_survives_a_checkpoint_mapped_onto_the_gpu(tmp_path: Path) -> None:
    _rng_roundtrip(tmp_path, torch.device("cuda", 0))


def test_rng_state_survives_a_checkpoint_on_cpu(tmp_path: Path) -> None:
    _rng_roundtrip(tmp_path, torch.device("cpu"))


@pytest.mark.gpu
def test_a_process_owns_its_block_of_real_devices() -> None:
    count = torch.cuda.device_count()
    assert process_devices(torch.device("cuda", 0), 0, count) == [torch.device("cuda", i) for i in range(count)]
    assert process_devices(torch.device("cuda", count - 1), count - 1, 1) == [torch.device("cuda", count - 1)]


def test_model_parallel_on_cpu_uses_the_cpu_for_every_stage() -> None:
    assert process_devices(torch.device("cpu"), 3, 2) == [torch.device("cpu")] * 2


@pytest.mark.gpu
def test_nccl_version_is_reported() -> None:
    _torch, cuda, nccl = versions()
    assert cuda == torch.version.cuda and nccl is not None and nccl.count(".") == 2


@pytest.mark.gpu
@pytest.mark.slow
def test_doctor_nccl_bandwidth_table_on_the_gpus() -> None:
    from tests.test_doctor_real import base_env, doctor

    ranks = torch.cuda.device_count()
    rc, doc, err = doctor("--bench", "--device=cuda", "--backend=nccl", "--max-size=1MiB", "--bench-seconds=0.05",
                          "--ops=all_reduce", env=base_env(), torchrun=ranks)
    assert rc == 0, err
    # an NCCL job's table also holds the gloo (CPU) comparison rows unless --no-gloo
    assert {b["backend"] for b in doc["bench"]} == {"nccl", "gloo"}
    bench = [b for b in doc["bench"] if b["op"] == "all_reduce" and b["backend"] == "nccl"]
    assert bench and all(b["time_us"] > 0 for b in bench)
    for b in bench:  # nccl-tests' bus bandwidth for all_reduce: algbw x 2(n-1)/n
        assert b["busbw_gbps"] == pytest.approx(b["algbw_gbps"] * 2 * (ranks - 1) / ranks, rel=1e-9)
