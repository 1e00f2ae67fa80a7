"""How the model is parallelised: DDP (optionally around a model split over
several devices), DataParallel (optionally balanced), ZeRO-sharded optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...shared.agreed import device_block
from ..config.values import TrainConfig
from .balanced_dp import BalancedDataParallel
from .build import StagedModel


class StrategyError(ValueError):
    """A parallel layout the machine cannot run; the message names the flag."""


@dataclass
class Parallel:
    module: nn.Module            # what the loop calls
    raw: StagedModel             # the unwrapped model, for checkpoints
    input_device: torch.device
    output_device: torch.device
    no_sync: Callable[[], ContextManager[None]]  # skip gradient all-reduce on accumulating micro-batches


def process_devices(base: torch.device, local_rank: int, per_process: int) -> list[torch.device]:
    """The devices one process owns: its block by the one ownership rule
    (agreed.device_block). On CPU the 'devices' are all `cpu`, which keeps
    the model-parallel code path testable without GPUs."""
    if base.type != "cuda":
        return [base] * per_process
    # start-up resolved the primary device by the same rule (a manual start may
    # have guessed it from the global rank): the block is the one it begins
    owner = local_rank if base.index is None else base.index // per_process
    return cuda_devices(owner, per_process, torch.cuda.device_count())


def cuda_devices(local_rank: int, per_process: int, visible: int) -> list[torch.device]:
    """The CUDA devices of a local rank's block among `visible` GPUs."""
    try:
        block = device_block(local_rank, per_process, visible)
    except ValueError as err:
        raise StrategyError(f"--devices-per-process {per_process}: {err}") from None
    return [torch.device("cuda", i) for i in block.indices]


def _ddp(model: StagedModel, args: TrainConfig, device: torch.device, local_rank: int,
         distributed: bool) -> Parallel:
    devices = process_devices(device, local_rank, args.devices_per_process)
    if args.sync_bn:
        if device.type != "cuda":
            raise StrategyError("--sync-bn needs CUDA devices (SyncBatchNorm has no CPU kernel); drop it on CPU")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if len(devices) > 1:
        model.place(devices)
    else:
        model.to(devices[0])
        model.devices = [devices[0]] * len(model.stages)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if not distributed:
        return Parallel(model, model, devices[0], devices[-1], contextlib.nullcontext)
    # a module spanning devices takes device_ids=None; DDP then all-reduces each device's grads in place
    ids = [devices[0]] if device.type == "cuda" and len(devices) == 1 else None
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return Parallel(wrapped, model, devices[0], devices[-1], wrapped.no_sync)


def _dp(model: StagedModel, args: TrainConfig, device: torch.device) -> Parallel:
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if device.type != "cuda":
        # No GPU to spread the batch over: the module as is, which is what torch's DataParallel is
        # on a host without CUDA; on a host with GPUs it would refuse a module left on the CPU.
        return Parallel(model, model, device, device, contextlib.nullcontext)
    if args.gpu0_batch is not None:
        wrapped: nn.Module = BalancedDataParallel(args.gpu0_batch, model)
    else:
        wrapped = nn.DataParallel(model)
    return Parallel(wrapped, model, device, device, contextlib.nullcontext)


def parallelise(model: StagedModel, args: TrainConfig, device: torch.device, local_rank: int,
                world_size: int, distributed: bool) -> Parallel:
    if args.activation_checkpointing:
        model.checkpointing = True
    if args.strategy == "dp":
        if world_size > 1:
            raise StrategyError(f"--strategy dp runs in one process, but world size is {world_size}; "
                                "use --strategy ddp or start a single process")
        par = _dp(model, args, device)
    else:
        par = _ddp(model, args, device, local_rank, distributed)
    if args.compile:
        par.module = torch.compile(par.module)  # type: ignore[assignment]  # a compiled module still is one
    return par


def make_optimizer(params: list[nn.Parameter], args: TrainConfig, lr: float,
                   distributed: bool) -> torch.optim.Optimizer:
    sgd: dict[str, Any] = {"lr": lr, "momentum": args.momentum, "weight_decay": args.weight_decay}
    if args.zero:
        if not distributed:
            raise StrategyError("--zero shards optimizer state across ranks; it needs a distributed run")
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, **sgd)
    return torch.optim.SGD(params, **sgd)
