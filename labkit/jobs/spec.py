"""What a job is before anything runs (a worker module, its typed configuration), and its folder.

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
dataclass of such fields. Every value takes its field's type when the config is built, from
Python or from JSON: a list becomes a tuple, a dict a nested dataclass
(``WorkerConfig.__post_init__``), so a config read back equals the one written.

The job folder is here too, for the same reason: the launcher (``labkit.jobs.launch``), a
rank (``labkit.jobs.runtime``), the process registry (``labkit.jobs.procs``) and an sbatch
script (``labkit.jobs.slurm``) all read or write it, and only the ranks need torch. The launcher
and the ranks talk through files in it (its path in the ``LABKIT_JOB_DIR`` environment
variable):

    job.json                 the job spec the launcher wrote: config, backend, timeouts
    rank{r}.json             what rank r passed to ``ctx.write_result``
    heartbeat/rank{r}.json   rank r's latest heartbeat: pid, node, step, phase, in a
                             collective or not, the part of the job running (if the worker
                             names one), and which restart of the job this process is
    stacks/rank{r}.txt       where rank r's threads were when asked (``STACK_SIGNAL``)
    agent.log                everything torchrun's agent printed
    torchrun/                torchrun's own per-rank logs (``--log-dir``)

Files, not sockets: they survive a crash, need no port, and a human can read them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Union

from labkit.validate import InvalidValue

C = TypeVar("C", bound="WorkerConfig")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Base of every worker's configuration: a frozen dataclass naming its worker module.

    Built from Python or from JSON, a config holds the types its fields declare: a list given
    for a tuple field becomes a tuple (so two equal configs compare equal, and a frozen config
    holds nothing mutable there), and a dict given for a dataclass field (``model=dict(n_layer=2)``
    for a ``ModelConfig``) becomes that dataclass, its fields over the field's default. A
    subclass's own ``__post_init__`` calls this one first, then checks the typed values.
    """

    WORKER: ClassVar[str] = ""
    """Dotted name of the worker module every rank runs (``labkit.workers.dp_train``)."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = _default(f)
            if isinstance(value, Mapping) and dataclasses.is_dataclass(default):
                value = _over(f.name, default, value)
            typed = _typed(hints.get(f.name, Any), value)
            if typed is not getattr(self, f.name):
                object.__setattr__(self, f.name, typed)  # frozen: normalised once, here

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` applied, typed and checked as a new config is
        (``dataclasses.replace``): ``cfg.replace(strategies=["ddp"], mesh=[4])``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (tuples become lists on the way through JSON)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """The config a rank was given (``ctx.config``), as this dataclass again. A name the
        dataclass does not have is refused by name: a misspelt field must not pass silently."""
        if not isinstance(values, dict):
            raise InvalidValue(f"{cls.__name__}: need a dict of its fields, got {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise InvalidValue(f"{cls.__name__} has no field(s) {unknown}; its fields are "
                               f"{sorted(fields)}")  # fmt: skip
        return cls(**values)  # __post_init__ gives each value its field's type


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The field types of ``cls``, resolved once per class (annotations are strings here)."""
    return typing.get_type_hints(cls)


def _default(f: dataclasses.Field) -> Any:
    """The field's default value (built, for a default factory), or None if it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _over(name: str, default: Any, values: Mapping[str, Any]) -> Any:
    """The dataclass ``default`` with the fields ``values`` names changed; a name it does not
    have is refused by name, as ``from_dict`` refuses one."""
    known = [f.name for f in dataclasses.fields(default)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise InvalidValue(f"{name}: {type(default).__name__} has no field(s) {unknown}; its "
                           f"fields are {sorted(known)}")  # fmt: skip
    inner = _hints(type(default))
    return dataclasses.replace(default, **{k: _typed(inner.get(k, Any), v) for k, v in values.items()})


def _typed(hint: Any, value: Any) -> Any:
    """``value`` made the type the field declares where JSON (or a caller) gave another:
    lists for tuples, dicts for nested dataclasses. Anything else is returned as it is, for
    the config's own checks to refuse by name."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _typed(options[0], value) if len(options) == 1 else value
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        return _over(hint.__name__, hint(), value) if _defaults_all(hint) else hint(**value)
    if origin is tuple and isinstance(value, list):
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v) for v in value)
        return tuple(_typed(a, v) for a, v in zip(args, value, strict=False)) if args else tuple(value)
    if origin is tuple and isinstance(value, tuple):
        typed = _typed(hint, list(value))
        return value if typed == value else typed  # the caller's tuple, unless a part changed
    if origin is list and isinstance(value, list):
        (arg,) = typing.get_args(hint) or (Any,)
        items = [_typed(arg, v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    if origin is dict and isinstance(value, dict):
        args = typing.get_args(hint)
        if not args:
            return value
        items = {k: _typed(args[1], v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    return value


def _defaults_all(cls: type) -> bool:
    """Whether every field of the dataclass ``cls`` has a default (``cls()`` can be built)."""
    return all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
               for f in dataclasses.fields(cls) if f.init)  # fmt: skip


def worker_of(config: WorkerConfig) -> str:
    """The worker module a config names, refused by name if its class names none."""
    module = type(config).WORKER
    if not module:
        raise InvalidValue(f"{type(config).__name__} names no worker module: give the class "
                           "WORKER = 'labkit.workers.<name>'")  # fmt: skip
    return module


# --- the job folder: its layout, and JSON files written whole ---------------------------------

JOB_DIR_ENV = "LABKIT_JOB_DIR"
"""The environment variable that gives every process of a job its folder."""
SPEC_FILE = "job.json"
AGENT_LOG = "agent.log"
TORCHRUN_LOGS = "torchrun"
RANK_PREFIX = "[rank${rank}] "
"""torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``: it substitutes ``${rank}``, so every
line a rank prints arrives as "[rank3] ..."."""
MAX_RANKS_PER_CORE = 4
"""CPU ranks per core allowed without ``oversubscribe=True``: two or four ranks on a two-core
laptop are a lesson in contention; ten thousand are a fork bomb."""


def result_path(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / f"rank{rank}.json"


def heartbeat_path(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / "heartbeat" / f"rank{rank}.json"


def stack_path(job_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its Python stacks when sent ``STACK_SIGNAL``."""
    return Path(job_dir) / "stacks" / f"rank{rank}.txt"


STACK_SIGNAL = signal.SIGUSR1
"""Sent by the launcher to a rank it is about to end for time: the rank writes where every
one of its threads is (``faulthandler``) to ``stack_path``, so the timeout can say where each
rank was stuck."""


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so a concurrent reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, allow_nan=True)  # before the file exists: a bad object leaves none
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic on POSIX
    except BaseException:
        # A full disk fails the write after the file was created: never leave it behind.
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None if it is missing or unreadable."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_heartbeats(job_dir: Path, ranks: int | Iterable[int]) -> dict[int, dict]:
    """Latest heartbeat of each of ``ranks`` (an int n: ranks 0..n-1) that has written one:
    {rank: heartbeat dict}."""
    beats = {}
    for rank in range(ranks) if isinstance(ranks, int) else ranks:
        beat = read_json(heartbeat_path(job_dir, rank))
        if beat is not None:
            beats[rank] = beat
    return beats
