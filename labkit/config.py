"""Typed, validated configuration for every lab.

Configs are frozen, keyword-only dataclasses. Each field says its unit in its name or its
docstring, and ``__post_init__`` rejects bad values with a ``ValueError`` that names the
field, the value and what is allowed, before anything is built or launched: first its type,
read from the field's annotation (:func:`_check_types`), then its range.

Presets are functions (as in torchtitan's ``config/``), one per size:

    smoke  CI and a first look: seconds on 2 CPU cores
    lab    a learner's default: a minute or two on a laptop CPU, seconds on a GPU
    gpu    sized for one modern data-centre GPU (bf16, long enough to reach steady state)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from labkit.dtypes import TRAINING as DTYPES
from labkit.validate import is_integer, is_real, shown

SIZES = ("smoke", "lab", "gpu")
CORPUS_VOCAB_SIZE = 256
"""Token ids in the course's corpus: it is tokenised as raw bytes, 0..255 (:mod:`labkit.data`),
so a model trained on it needs ``vocab_size >= 256``."""


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: {allowed}")


# --- types, from the annotations ---------------------------------------------------------------
# One checker for every field of every config, driven by the dataclass's own annotations, so a
# new field is checked the day it is added. bool is not accepted as a number, although Python
# makes it an int subclass: lr=True is a mistake, never a learning rate of 1. An int is a fine
# float (lr=1); a float is not an int (n_layer=2.0), since a float there comes from arithmetic
# that should have been integer. numbers.Integral and numbers.Real admit numpy's scalars (a sweep
# over np.arange), stored as Python's int and float so that the config stays JSON-serialisable.

_WANTED = {bool: "True or False", int: "an int", float: "a number", str: "a str"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolves the string annotations of `from __future__`


def _check_types(config: Any) -> None:
    """Check (and normalise) every field of the config dataclass ``config`` against its
    annotation; raise ValueError naming the field, the value, the type wanted and an example."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        checked = _checked(f, hints[f.name], value)
        if checked is not value:
            object.__setattr__(config, f.name, checked)  # frozen: the documented way in


def _checked(f: dataclasses.Field, hint: Any, value: Any) -> Any:
    """``value`` if it is of type ``hint`` (as a Python int or float where one is meant)."""
    optional = typing.get_origin(hint) in (types.UnionType, typing.Union)
    if optional:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]  # X | None only
        if value is None:
            return None
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = is_integer(value)
    elif hint is float:
        ok = is_real(value)  # NaN and infinities too: refused below, as not finite
    elif hint is str or dataclasses.is_dataclass(hint):
        ok = isinstance(value, hint)
    else:
        raise TypeError(f"{f.name}: labkit.config has no type check for {hint}")
    if not ok:
        wanted = _WANTED.get(hint, f"a {hint.__name__}") + " or None" * optional
        what = "" if value is None else f" is {_article(type(value).__name__)}"
        raise ValueError(f"{f.name}={value!r}{what}: give {wanted}, e.g. {_example(f, hint)}")
    if hint is float and not math.isfinite(value):
        raise ValueError(f"{f.name}={value!r} is not finite: give a finite number, "
                         f"e.g. {_example(f, hint)}")  # fmt: skip
    return int(value) if hint is int else float(value) if hint is float else value


def _example(f: dataclasses.Field, hint: Any) -> str:
    """``name=value`` with a right value: the field's ``example`` metadata, else its default."""
    if dataclasses.is_dataclass(hint):
        return f"{f.name}={hint.__name__}(...)"
    return f"{f.name}={f.metadata.get('example', f.default)!r}"


def _article(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the GPT in :mod:`labkit.model` (GPT-2 style, pre-norm, tied embeddings)."""

    vocab_size: int = 256
    """Tokens in the vocabulary. 256: the corpus is tokenised as raw bytes."""
    seq_len: int = 128
    """Context length s in tokens (the learned position table has this many rows)."""
    n_layer: int = 4
    """Transformer blocks L."""
    n_head: int = 4
    """Attention heads a; must divide d_model."""
    d_model: int = 128
    """Hidden size h."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps runs deterministic and comparable."""
    tie_weights: bool = True
    """Share the token embedding with the output head (GPT-2). Pipeline stages that hold the
    embedding and the head on different ranks may turn it off."""

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            _require(value >= 1, name, value, "a positive integer")
        _require(
            self.d_model % self.n_head == 0,
            "n_head",
            self.n_head,
            f"a divisor of d_model={self.d_model} (each head gets d_model/n_head channels)",
        )
        _require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a probability in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: batch, optimiser, precision and length."""

    micro_batch: int = 16
    """Sequences per forward/backward on one rank (b)."""
    grad_accum: int = 1
    """Micro-batches accumulated before each optimiser step."""
    steps: int = 100
    """Optimiser steps."""
    lr: float = 3e-3
    """Peak learning rate for AdamW."""
    warmup_steps: int = 0
    """Optimiser steps over which the learning rate rises linearly from lr/warmup_steps to
    lr (see :func:`labkit.train.lr_at`); 0 starts at lr. A run shorter than this never
    reaches lr."""
    min_lr: float | None = field(default=None, metadata={"example": 3e-4})
    """After warm-up, decay the learning rate along a cosine from lr to this value at the
    last step; None keeps it at lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    adam_eps: float = 1e-8
    """AdamW's epsilon, added to the root of the second moment (PyTorch's default). It sets the
    gradient size below which updates shrink: scale it with the loss to keep AdamW invariant."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    dtype: str = "float32"
    """Autocast dtype: float32 (autocast off), bfloat16 or float16."""
    device: str = "auto"
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    seed: int = 0
    """Seed for parameter initialisation and batch sampling."""
    eval_every: int = 0
    """Evaluate on validation data every this many steps; 0 disables."""

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("micro_batch", "grad_accum", "steps"):
            value = getattr(self, name)
            _require(value >= 1, name, value, "a positive integer")
        _require(self.lr > 0, "lr", self.lr, "a positive number")
        _require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps,
                 "zero (no warm-up) or a positive integer")
        _require(self.min_lr is None or 0 <= self.min_lr <= self.lr, "min_lr", self.min_lr,
                 f"None (no decay) or a number from 0 to lr={self.lr}")
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "zero or more")
        _require(self.adam_eps > 0, "adam_eps", self.adam_eps, "a positive number (1e-8)")
        _require(
            self.grad_clip is None or self.grad_clip > 0,
            "grad_clip",
            self.grad_clip,
            "a positive number or None",
        )
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _require(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            self.device,
            "'auto', 'cpu', 'cuda' or 'cuda:N'",
        )
        _require(self.eval_every >= 0, "eval_every", self.eval_every,
                 "zero (off) or a positive integer")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A model and how to train it: what a lab passes to a worker."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _check_types(self)
        # Every lab trains on the byte corpus. A smaller vocabulary would fail only at the first
        # forward pass, as an IndexError from the embedding (a device-side assert on a GPU). A
        # ModelConfig alone may be smaller: it is a shape, counted or split without data.
        vocab = self.model.vocab_size
        if vocab < CORPUS_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={vocab} is too small for the corpus: it is tokenised as raw bytes "
                f"(token ids 0..{CORPUS_VOCAB_SIZE - 1}), so vocab_size must be >= "
                f"{CORPUS_VOCAB_SIZE}; use vocab_size={CORPUS_VOCAB_SIZE}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunConfig:
        """The config :meth:`to_dict` wrote: ``{"model": {...}, "train": {...}}``, each a dict of
        that section's fields (a field left out keeps its default). A missing or unknown
        section or field is refused with the known ones and an example (ValueError)."""
        sections = {"model": ModelConfig, "train": TrainConfig}
        if not isinstance(d, Mapping):
            raise ValueError(f"RunConfig.from_dict: {shown(d)} is not a dict: give "
                             f"{{'model': {{...}}, 'train': {{...}}}}, {_FROM_DICT_EXAMPLE}")
        missing = [name for name in sections if name not in d]
        unknown = [name for name in d if name not in sections]
        if missing or unknown:
            what = [f"no {' or '.join(map(repr, missing))} section"] if missing else []
            what += [f"unknown section {', '.join(map(repr, unknown))}"] if unknown else []
            raise ValueError(f"RunConfig.from_dict: the dict has {' and '.join(what)}: give "
                             f"exactly the sections 'model' and 'train', {_FROM_DICT_EXAMPLE}")
        parts = {name: _section(name, section, d[name]) for name, section in sections.items()}
        return cls(**parts)

    def replace(self, **changes: object) -> RunConfig:
        """Copy with fields changed; names are looked up in ``model`` then ``train``.

        >>> preset("smoke").replace(steps=5).train.steps
        5
        """
        model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
        train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
        m = {k: v for k, v in changes.items() if k in model_fields}
        t = {k: v for k, v in changes.items() if k in train_fields}
        unknown = set(changes) - model_fields - train_fields
        if unknown:
            raise ValueError(
                f"unknown config field(s) {sorted(unknown)}; model fields: "
                f"{sorted(model_fields)}, train fields: {sorted(train_fields)}"
            )
        return RunConfig(
            model=dataclasses.replace(self.model, **m),
            train=dataclasses.replace(self.train, **t),
        )


_FROM_DICT_EXAMPLE = ("each a dict of its fields (a field left out keeps its default), "
                      "e.g. {'model': {'n_layer': 2}, 'train': {'steps': 10}}, or "
                      "preset('smoke').to_dict() for every field")


def _section(name: str, cls: type, fields: object) -> Any:
    """``cls(**fields)`` for the section ``name`` of :meth:`RunConfig.from_dict`; a value that
    is not a dict, or a field the dataclass does not have, is refused naming the known ones."""
    known = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(fields, Mapping):
        what = "None" if fields is None else f"{shown(fields)}, {_article(type(fields).__name__)}"
        raise ValueError(f"RunConfig.from_dict: {name!r} is {what}: give a dict of "
                         f"{cls.__name__}'s fields, e.g. {{}} for its defaults; its fields: "
                         f"{', '.join(known)}")  # fmt: skip
    for key in fields:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"RunConfig.from_dict: {name} has unknown field {shown(key)}{hint}; "
                             f"{cls.__name__}'s fields: {', '.join(known)}")  # fmt: skip
    return cls(**fields)


def parse_json_object(text: str, option: str) -> dict[str, Any]:
    """A command-line option's value (``--config``) read as a JSON object; anything else is a
    ValueError that says the option takes JSON, with an example built from what was typed."""
    try:
        value = json.loads(text)
    except ValueError:
        example = _as_json_example(text)
        quotes = " (JSON strings and keys take double quotes)" if "'" in text else ""
        raise ValueError(
            f"{option} {shown(text)} is not JSON: {option} takes a JSON object{quotes}, in "
            f"single quotes for the shell, e.g. {option} '{example}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} {shown(text)} is JSON but not an object: give the fields in "
                         f"braces, e.g. {option} '{{\"numel\": 4}}'")  # fmt: skip
    return value


def _as_json_example(text: str) -> str:
    """``numel=4,name=x`` written as the JSON object it probably meant; a fixed example when
    ``text`` is not in that form."""
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    if not pairs or any(len(p) != 2 or not p[0].strip().isidentifier() for p in pairs):
        return '{"numel": 4}'
    obj: dict[str, Any] = {}
    for key, raw in pairs:
        try:
            obj[key.strip()] = json.loads(raw)
        except ValueError:
            obj[key.strip()] = raw.strip()  # not a JSON value: a string
    return json.dumps(obj)


# Every preset warms the learning rate up and then decays it along a cosine to a tenth of its
# peak, as GPT-2-style training does (nanoGPT's train.py, get_lr; min_lr = learning_rate/10
# in its configs, after Chinchilla, Hoffmann et al. 2022). The warm-up is counted in steps,
# not as a share of the run: it is the customary guard for Adam's first updates (see
# labkit.train.lr_at), and how many of those a model survives does not depend on how long the
# run goes on afterwards. The peak rates are measured choices, and at these sizes the peak
# decided more than the warm-up did. lab used to train at a constant 3e-3, and its loss
# leapt from 3.5 to 9.7 at steps 9-12. Leaps above ln 256 in the first 40 steps of the lab
# preset (float32, CPU), by seed: constant 3e-3, 1 of seeds 0-3; a 20-step warm-up to 3e-3,
# 1 of 4; to 2e-3, 1 of 4; to 1.5e-3, 0 of 4; constant 1e-3, 0 of 4; a 20-step warm-up to
# 1e-3, 0 of seeds 0-7. (Seed 0, the notebooks', with the cosine to lr/10 over 200 steps:
# constant 3e-3 leapt to 8.87 at step 9; a 20-step warm-up to 3e-3 peaked at 5.26, at step 2;
# constant 1e-3 at 4.99, at step 2. The warm-up saved seed 0 at 3e-3, not the seed that leapt
# with it.) So lab peaks at 1e-3, the rate of nanoGPT's "baby GPT"
# (config/train_shakespeare_char.py), with room to spare. smoke, 64 wide, showed no leap in
# 8 seeds even at a constant 3e-3 (nor at 3e-2) and keeps 3e-3: at 1e-3 its 30 steps end
# at 4.1 instead of 3.3. gpu keeps 1e-3 with a 30-step warm-up: its model, run on a CPU in
# float32 with micro-batches of 8 instead of 32, stayed below ln 256 for 40 steps both with
# and without the warm-up, and was 0.26 lower at step 40 with it (2.78).


def smoke() -> RunConfig:
    """CI size: a 2-layer, 64-wide GPT (~0.1 M parameters) for a few steps."""
    return RunConfig(
        model=ModelConfig(seq_len=64, n_layer=2, n_head=2, d_model=64),
        train=TrainConfig(micro_batch=8, steps=30, lr=3e-3, warmup_steps=5, min_lr=3e-4),
    )


def lab() -> RunConfig:
    """A learner's default on a laptop CPU: ~0.8 M parameters, loss visibly falls."""
    return RunConfig(
        model=ModelConfig(seq_len=128, n_layer=4, n_head=4, d_model=128),
        train=TrainConfig(micro_batch=16, steps=200, lr=1e-3, warmup_steps=20, min_lr=1e-4),
    )


def gpu() -> RunConfig:
    """One data-centre GPU: a ~26 M-parameter GPT in bf16, big enough to load the GPU.

    bf16 asks for Ampere's tensor cores (compute capability 8.0 and newer); the notebooks pass
    this dtype through ``hardware.default_autocast_dtype``, which gives a V100 or T4 float16
    with a GradScaler instead."""
    return RunConfig(
        model=ModelConfig(seq_len=512, n_layer=8, n_head=8, d_model=512),
        train=TrainConfig(micro_batch=32, steps=300, lr=1e-3, warmup_steps=30, min_lr=1e-4,
                          dtype="bfloat16"),
    )


_PRESETS = {"smoke": smoke, "lab": lab, "gpu": gpu}


ENVIRONMENT: dict[str, str] = {
    "LABKIT_SIZE": "the notebooks' size: smoke, lab or gpu (read by each parameters cell)",
    "LABKIT_CAPSTONE_JOB": "notebook 07's job: the job code that plants its faults (default: a fresh one)",
    "LABKIT_HOME": "where jobs, logs and exercise files go (default ~/.cache/labkit)",
    "LABKIT_KEEP_RUNS": "how many job folders to keep (default 50)",
    "LABKIT_LIVE_PLOTS": "0 or 1: force the monitor's live plots off or on",
    "LABKIT_VENV": "the virtual environment ./course makes",
    "LABKIT_KEEP_TORCH": "1: ./course keeps the torch already installed",
    "LABKIT_CHROMIUM": "the browser the browser test drives",
    "LABKIT_ARTIFACTS": "where the browser test leaves its screenshots",
    "LABKIT_TEST_WORKERS": "how many pytest processes ./course test runs side by side (default 2)",
    "LABKIT_GPU_TRACES": "a folder of real GPU profiler traces laid out as HTA's tests/data: "
                         "notebook 06 and the tests read them (else ../shared/gpu-traces, "
                         "else `python -m labkit public-traces fetch`'s download)",
    "LABKIT_OFFLINE": "1: labkit never reaches the network (notebook 06 downloads no public "
                      "traces; the test suite sets it)",
    "LABKIT_JOB_DIR": "set by the launcher for each job (internal)",
    "LABKIT_AGENT_PID": "set by the launcher for each job (internal)",
    "LABKIT_TEST_SESSION": "set by the test suite (internal)",
    "LABKIT_SLURM_TEST": "set by the SLURM test on its cluster's daemons (internal)",
    "LABKIT_EXPECT_SOLVED": "1: every exercise check must pass (complete notebooks)",
    "LABKIT_EXECUTED_DIR": "where the test suite also saves each learner's notebook it "
                           "executed, for ./course book --executed (CI sets it)",
}
"""Every ``LABKIT_*`` environment variable labkit reads, with what it sets. There is one size
switch, ``LABKIT_SIZE``; another spelling (``LABKIT_SMOKE=1``) would be silently ignored, so
:func:`check_environment` refuses it."""


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise ValueError for a ``LABKIT_*`` variable labkit does not read, naming the fix."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("LABKIT_") and k not in ENVIRONMENT)
    if not unknown:
        return
    name = unknown[0]
    # Compared without the shared prefix, which would make every name look close.
    close = [f"LABKIT_{m}" for m in difflib.get_close_matches(
        name.removeprefix("LABKIT_"), [k.removeprefix("LABKIT_") for k in ENVIRONMENT], n=1)]
    if name in ("LABKIT_SMOKE", "LABKIT_LAB", "LABKIT_GPU", "LABKIT_PRESET"):
        fix = f"use LABKIT_SIZE={name.removeprefix('LABKIT_').lower()} (smoke, lab or gpu)"
        if name == "LABKIT_PRESET":
            fix = "use LABKIT_SIZE=smoke, lab or gpu"
    elif close:
        fix = f"did you mean {close[0]} ({ENVIRONMENT[close[0]]})?"
    else:
        fix = f"labkit reads only {', '.join(ENVIRONMENT)}"
    raise ValueError(f"the environment sets {name}, which labkit does not read: {fix}; "
                     f"unset {name}")  # fmt: skip


def preset(size: str) -> RunConfig:
    """The preset called ``size`` (one of :data:`SIZES`).

    Also checks the environment (:func:`check_environment`): every notebook asks for its
    preset first, so a misspelt size switch stops it before anything runs.
    """
    _require(size in _PRESETS, "size", size, f"one of {SIZES}")
    check_environment()
    return _PRESETS[size]()


def override(cfg: RunConfig, **changes: object) -> RunConfig:
    """``cfg`` with the ``changes`` that are not None (a notebook's parameters cell: None keeps
    the preset's value). A new peak ``lr`` brings ``min_lr`` to a tenth of it, so that the
    cosine still ends at a tenth of the peak, as in every preset.

    >>> override(preset("smoke"), steps=None, lr=2e-3).train.min_lr
    0.0002
    """
    kept = {k: v for k, v in changes.items() if v is not None}
    if "lr" in kept and "min_lr" not in kept:
        kept["min_lr"] = kept["lr"] / 10
    return cfg.replace(**kept)
