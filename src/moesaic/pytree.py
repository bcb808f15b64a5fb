"""The router's outputs as pytree nodes, so that torch's tree utilities see their tensors.

``torch.utils._pytree.tree_flatten`` takes an unregistered dataclass for one leaf. FSDP2 before
torch 2.13 finds the tensors of a unit's forward output that way, to hook its pre-backward
all-gather onto them: the router, an FSDP2 unit of its own (``train.fsdp.shard_model``),
returns a ``RoutingPlan`` and ``AuxTerms``, so on those versions its weight was never gathered
again for the backward, which failed on the freed storage (seen on an H200 with torch 2.11,
``benchmarks/results/gpu_tests_h200.log``). Torch 2.13's FSDP2 walks dataclasses itself;
registering them works on every version.

A registered dataclass flattens to its fields' values (tensors and the rest alike: a leaf that
is no tensor is left alone by every tensor utility) and unflattens to an equal instance, built
without ``__init__`` (``RoutingPlan``'s takes other arguments): the fields are set as a frozen
dataclass' own ``__init__`` sets them, fields declared ``init=False`` (caches) anew empty.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from torch.utils import _pytree

__all__ = ["register_dataclass_node"]

_T = TypeVar("_T")


def register_dataclass_node(cls: type[_T]) -> type[_T]:
    """Register dataclass ``cls`` as a pytree node (a class decorator): children are the
    values of its fields declared ``init=True``, the context their names; ``init=False``
    fields (caches) come back as a fresh value of their ``default_factory``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_dataclass_node takes a dataclass, got {cls!r}")
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    caches = tuple(
        (f.name, f.default_factory)
        for f in dataclasses.fields(cls)
        if not f.init and f.default_factory is not dataclasses.MISSING
    )

    def flatten(obj: Any) -> tuple[list[Any], tuple[str, ...]]:
        return [getattr(obj, n) for n in names], names

    def unflatten(values: Any, context: tuple[str, ...]) -> Any:
        obj = object.__new__(cls)
        for name, value in zip(context, values, strict=True):
            object.__setattr__(obj, name, value)
        for name, factory in caches:
            object.__setattr__(obj, name, factory())
        return obj

    _pytree.register_pytree_node(
        cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}"
    )
    return cls
