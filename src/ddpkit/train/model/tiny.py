"""`--model tiny`: a few thousand parameters in three Conv-BN-ReLU stages, for
runs whose point is the plumbing (ranks, rendezvous, checkpoints, targets),
not the model: no torchvision import, a tiny all-reduce and checkpoint, so a
multi-node smoke run takes seconds on a CPU. Its BatchNorm buffers and three
stages still exercise buffer broadcast, activation checkpointing and
splitting over devices."""

from __future__ import annotations

from torch import nn


def cnn(num_classes: int = 10) -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(8, num_classes)),
    )
