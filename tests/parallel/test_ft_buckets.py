"""Fault tolerance's gradient buckets (app/parallel/ft_buckets.py): made as DDP makes its first ones, so
that the all-reduce of the layers backward finishes first overlaps the backward of the layers below.
That the bucketed all-reduce equals DDP bit for bit: tests/fault/test_torchft.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.models.nets import ConvNet
from app.parallel.ft_buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, assign_buckets

pytestmark = pytest.mark.quick


def names(module: nn.Module, buckets: list[list[nn.Parameter]]) -> list[list[str]]:
    name_of = {id(param): name for name, param in module.named_parameters()}
    return [[name_of[id(param)] for param in bucket] for bucket in buckets]


def test_the_bench_cnn_sends_its_last_layers_while_backward_computes_the_convolutions() -> None:
    """configs/bench_cnn.yaml's CNN: the fully connected layers (backward's first gradients, 4.7 MB)
    fill the first bucket; the convolutions, whose backward it overlaps, are the second."""
    cnn = ConvNet(in_channels=1, num_classes=10)
    buckets = names(cnn, assign_buckets(list(cnn.parameters())))
    assert buckets == [
        ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"],
        ["conv2.bias", "conv2.weight", "conv1.bias", "conv1.weight"],
    ]


def test_buckets_hold_one_dtype_close_at_ddps_sizes_and_cover_every_parameter_once() -> None:
    layers = [nn.Linear(512, 512) for _ in range(30)]  # 1 MiB of float32 weights each
    layers[3].to(torch.float64)
    model = nn.Sequential(*layers)
    params = list(model.parameters())
    buckets = assign_buckets(params)
    assert sorted(id(param) for bucket in buckets for param in bucket) == sorted(id(param) for param in params)
    assert all(len({param.dtype for param in bucket}) == 1 for bucket in buckets)
    flat = [param for bucket in buckets for param in bucket if param.dtype == torch.float32]
    assert flat == [param for param in reversed(params) if param.dtype == torch.float32]  # backward's order
    sizes = [sum(param.numel() * param.element_size() for param in bucket) for bucket in buckets]
    float32 = [size for bucket, size in zip(buckets, sizes, strict=True) if bucket[0].dtype == torch.float32]
    assert FIRST_BUCKET_BYTES <= float32[0] < 2 * FIRST_BUCKET_BYTES  # the first closes early, as DDP's
    assert all(BUCKET_BYTES <= size < BUCKET_BYTES + 2 * FIRST_BUCKET_BYTES for size in float32[1:-1])
