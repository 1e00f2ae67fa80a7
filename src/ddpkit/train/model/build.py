"""Models as a sequence of stages: the unit for activation checkpointing and
for splitting one model over several devices (DDP around model parallel).

torchvision ResNets are cut into stem, layer1..layer4 and head; inside each
stage the modules keep torchvision's names (stages.1.0.conv1 is layer1.0.conv1).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

SMALL_IMAGE_MAX = 64
# Built-in models that are not torchvision ResNets, by name: their factory.
BUILT_IN = {"tiny": "ddpkit.train.model.tiny:cnn"}


class ModelError(ValueError):
    """A model that cannot be built as asked; the message names the flag."""


class StagedModel(nn.Module):
    """Runs `stages` in order; each stage may live on its own device and may be
    recomputed in backward instead of keeping its activations."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.devices: list[torch.device | None] = [None] * len(stages)
        self.checkpointing = False

    def place(self, devices: list[torch.device]) -> None:
        """Spread the stages over `devices` in contiguous groups of roughly equal parameter count."""
        sizes = [sum(p.numel() for p in s.parameters()) for s in self.stages]
        total, acc = max(sum(sizes), 1), 0
        for i, (stage, size) in enumerate(zip(self.stages, sizes)):
            # the stage goes to the device whose share its parameter midpoint falls in
            slot = min(int((acc + size / 2) / total * len(devices)), len(devices) - 1)
            acc += size
            self.devices[i] = devices[slot]
            stage.to(devices[slot])

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1] or next(self.parameters()).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            if device is not None and x.device != device:
                x = x.to(device, non_blocking=True)
            if self.checkpointing and self.training and any(p.requires_grad for p in stage.parameters()):
                x = checkpoint(stage, x, use_reentrant=False)
            else:
                x = stage(x)
        return x


def _resnet_stages(name: str, num_classes: int, image_size: int) -> list[nn.Module]:
    import torchvision

    net = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if image_size <= SMALL_IMAGE_MAX:
        # CIFAR-style stem: a 7x7/2 conv and a maxpool would shrink 32px to 8px before layer1
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    stem = nn.Sequential(OrderedDict(conv1=net.conv1, bn1=net.bn1, relu=net.relu, maxpool=net.maxpool))
    head = nn.Sequential(OrderedDict(avgpool=net.avgpool, flatten=nn.Flatten(1), fc=net.fc))
    return [stem, net.layer1, net.layer2, net.layer3, net.layer4, head]


def _factory(spec: str) -> Callable[..., nn.Module]:
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable[..., nn.Module] = getattr(importlib.import_module(module_name), attr)  # the user's word for it
        return factory
    except (ImportError, AttributeError) as exc:
        raise ModelError(f"--model {spec}: cannot import {attr} from {module_name} ({exc})") from exc


def is_torchvision_resnet(name: str) -> bool:
    """A bare name (resnet18, ...) but a built-in one is a torchvision ResNet; `module:fn` is the user's factory."""
    return ":" not in name and name not in BUILT_IN


def build_model(name: str, num_classes: int, image_size: int) -> StagedModel:
    if is_torchvision_resnet(name):
        return StagedModel(_resnet_stages(name, num_classes, image_size))
    model = _factory(BUILT_IN.get(name, name))(num_classes=num_classes)
    if isinstance(model, StagedModel):
        return model
    # an nn.Sequential's children are its stages; any other module is one stage
    stages = list(model.children()) if isinstance(model, nn.Sequential) else [model]
    return StagedModel(stages)
