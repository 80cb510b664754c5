"""Streaming DiLoCo's fragments: which of a model's parameters sync together (`fragments: F` of
strategy diloco, app/parallel/diloco.py; the reference's app/reference/diloco.py uses the same cut).

A **block** is a module held in an `nn.ModuleList` (a transformer's layers, as FSDP's default shard
units), or, in a model without one, each module that holds parameters itself (a layer: each `Linear`
of an MLP). Fragment f is blocks [f x B / F, (f + 1) x B / F) of the B blocks, so F must divide B.
A parameter outside every block (embeddings, a final norm, a head) joins the fragment of the block
before it in `named_parameters()` order, or the first fragment if no block comes before it. Only
trainable parameters count. No Lightning here: the launcher's config check and the reference import it.
"""

from __future__ import annotations

from torch import nn


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters DiLoCo syncs: the trainable ones, in `named_parameters()` order."""
    return [(name, parameter) for name, parameter in module.named_parameters() if parameter.requires_grad]


def blocks(module: nn.Module) -> list[str]:
    """The names of the model's blocks, in order (module docstring)."""
    held = [
        f"{name}.{index}" if name else str(index)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.ModuleList)
        for index, element in enumerate(sub)
        if any(parameter.requires_grad for parameter in element.parameters())
    ]
    if held:
        return held
    return [
        name
        for name, sub in module.named_modules()
        if any(parameter.requires_grad for parameter in sub.parameters(recurse=False))
    ]


def fragment_indices(module: nn.Module, fragments: int) -> list[list[int]]:
    """For each fragment, the indices into `trainable(module)` of its parameters. Raises ValueError when
    `fragments` does not divide the blocks (the callers turn it into their one line)."""
    names = blocks(module)
    if not names or len(names) % fragments:
        raise ValueError(f"{len(names)} blocks")
    block_of = 0
    parts: list[list[int]] = [[] for _ in range(fragments)]
    for index, (name, _) in enumerate(trainable(module)):
        owner = next((i for i, block in enumerate(names) if name.startswith(f"{block}.")), None)
        if owner is not None:
            block_of = owner
        parts[block_of * fragments // len(names)].append(index)
    return parts
