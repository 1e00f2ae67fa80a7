"""Tiny models for `ddpkit train --model tests.helpers.tiny:NAME` in tests: a few
thousand parameters, so real multi-process runs take seconds on two cores."""

from torch import nn


def cnn(num_classes: int = 10) -> nn.Sequential:
    """Conv-BN-ReLU stages: exercises BatchNorm buffers, checkpointing and splitting."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(8, num_classes)),
    )
