"""Pytree registration of the dataclasses that cross compile, export and replay boundaries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.utils._pytree import GetAttrKey, register_pytree_node

T = TypeVar("T")
Context = tuple[tuple[str, ...], tuple[Any, ...]]  # (names of non-None children, static values)


def pytree_dataclass(*static: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: registers a dataclass as a pytree node.

    Fields named in ``static`` (host ints, strings, flags) go into the tree's context, so
    they are compared, not mapped; so do the names of ``None``-valued fields (a missing
    optional tensor is no leaf). Every other field is a child: a tensor or a nested pytree
    such as a tuple of dataclasses. Uses ``register_pytree_node``, which torch 2.11 and 2.13
    share. The context is saved as JSON (``torch.export.save``) and comes back as the same
    tuples. The class is also a safe global of ``torch.load(weights_only=True)``: torch 2.11's
    ``torch.export.save`` pickles a program's example inputs, such as a ``Batch``.
    """

    def register(cls: type[T]) -> type[T]:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(static) - set(names)
        if unknown:
            raise ValueError(f"pytree_dataclass: {cls.__name__} has no fields {sorted(unknown)}")
        fields = [n for n in names if n not in static]

        def flatten(obj: T) -> tuple[list[Any], Context]:
            children = tuple(n for n in fields if getattr(obj, n) is not None)
            return ([getattr(obj, n) for n in children],
                    (children, tuple(getattr(obj, n) for n in static)))

        def flatten_with_keys(obj: T) -> tuple[list[tuple[GetAttrKey, Any]], Context]:
            values, context = flatten(obj)
            return [(GetAttrKey(n), v) for n, v in zip(context[0], values)], context

        def unflatten(values: Iterable[Any], context: Context) -> T:
            children, static_values = context
            kwargs = dict.fromkeys(fields) | dict(zip(children, values))
            return cls(**kwargs, **dict(zip(static, static_values)))

        register_pytree_node(cls, flatten, unflatten,
                             serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                             to_dumpable_context=lambda context: context,
                             from_dumpable_context=_tuples,
                             flatten_with_keys_fn=flatten_with_keys)
        torch.serialization.add_safe_globals([cls])
        return cls

    return register


def _tuples(value: Any) -> Any:
    """``value`` with every JSON list turned back into a tuple."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
