"""What a job is, before anything runs: a worker module and its typed configuration.

This module imports neither torch nor any worker, so a notebook's kernel, the launcher and the
tests can build and check a job's configuration cheaply. Each worker in ``labkit/workers/``
declares its configuration as a frozen dataclass that subclasses :class:`WorkerConfig` and
names its module in ``WORKER``; ``launch.run(config)`` then needs nothing else to know what to
start, and a rank reads the same dataclass back with ``type(config).from_dict(ctx.config)``::

    @dataclasses.dataclass(frozen=True)
    class AllReduceConfig(WorkerConfig):
        WORKER: ClassVar[str] = "labkit.workers.allreduce"
        sizes: tuple[int, ...] = (1 << 10, 1 << 20)
        repeats: int = 5

        def __post_init__(self):
            validate.whole("repeats", self.repeats, low=1)

    launch.run(AllReduceConfig(repeats=10), nproc=2)

The config travels to every rank as JSON (the job folder's spec file), so a field holds what
JSON holds: numbers, strings, booleans, None, and lists, tuples and dicts of them, or a nested
dataclass of such fields. Tuples come back as tuples (``from_dict`` follows the field types).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, ClassVar, TypeVar, Union

from labkit.validate import InvalidValue

C = TypeVar("C", bound="WorkerConfig")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Base of every worker's configuration: a frozen dataclass naming its worker module."""

    WORKER: ClassVar[str] = ""
    """Dotted name of the worker module every rank runs (``labkit.workers.dp_train``)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (tuples become lists on the way through JSON)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """The config a rank was given (``ctx.config``), as this dataclass again. A name the
        dataclass does not have is refused by name: a misspelt field must not pass silently."""
        if not isinstance(values, dict):
            raise InvalidValue(f"{cls.__name__}: need a dict of its fields, got {type(values).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise InvalidValue(f"{cls.__name__} has no field(s) {unknown}; its fields are "
                               f"{sorted(fields)}")  # fmt: skip
        hints = typing.get_type_hints(cls)
        return cls(**{k: _typed(hints.get(k, Any), v) for k, v in values.items()})


def _typed(hint: Any, value: Any) -> Any:
    """``value`` from JSON, made the type the field declares where JSON lost it (tuples,
    nested dataclasses)."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _typed(options[0], value) if len(options) == 1 else value
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        inner = typing.get_type_hints(hint)
        return hint(**{k: _typed(inner.get(k, Any), v) for k, v in value.items()})
    if origin is tuple and isinstance(value, list):
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v) for v in value)
        return tuple(_typed(a, v) for a, v in zip(args, value, strict=False)) if args else tuple(value)
    if origin is list and isinstance(value, list):
        (arg,) = typing.get_args(hint) or (Any,)
        return [_typed(arg, v) for v in value]
    if origin is dict and isinstance(value, dict):
        args = typing.get_args(hint)
        return {k: _typed(args[1], v) for k, v in value.items()} if args else value
    return value


def worker_of(config: WorkerConfig) -> str:
    """The worker module a config names, refused by name if its class names none."""
    module = type(config).WORKER
    if not module:
        raise InvalidValue(f"{type(config).__name__} names no worker module: give the class "
                           "WORKER = 'labkit.workers.<name>'")  # fmt: skip
    return module
