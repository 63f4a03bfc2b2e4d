"""What the workers' typed configs share: the small GPT they build, its training, list checks.

The tensor-, sequence-, pipeline-, expert- and mesh-parallel workers all train (or step) the
course GPT on a few batches of real text; their configs differ only in defaults and in the
fields of their own strategy. Those shared fields, their checks and the ``ModelConfig`` /
``TrainConfig`` they make live here once, for each worker's config to subclass. No torch: a
kernel builds and checks a config before anything starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import ClassVar

from labkit import validate
from labkit.config import ModelConfig, RunConfig, TrainConfig
from labkit.jobs.spec import WorkerConfig


def some_of(name: str, values: Sequence[str], choices: Collection[str]) -> tuple[str, ...]:
    """``values`` as a tuple, if it is a non-empty list of ``choices`` (each refused by name)."""
    if isinstance(values, str) or not values:
        raise validate.refuse(name, values, "a non-empty list of " + ", ".join(map(repr, choices)))
    for value in values:
        validate.one_of(name, value, choices)
    return tuple(values)


def counts(name: str, values: Sequence[int], *, why: str = "") -> tuple[int, ...]:
    """``values`` as a tuple, if it is a non-empty list of positive integers (sizes, counts)."""
    if isinstance(values, str) or not values:
        raise validate.refuse(name, values, "a non-empty list of positive integers", why=why)
    return tuple(validate.whole(name, v, low=1, why=why) for v in values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTJobConfig(WorkerConfig):
    """A job on the course GPT: its shape, the batch, the seed."""

    ON_CORPUS: ClassVar[bool] = True
    """The model reads the byte corpus, so its vocabulary must hold every byte (RunConfig)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The GPT the job builds; each worker's config declares its own small default. A dict of
    ``ModelConfig`` fields is taken as changes to that default (``model=dict(n_layer=2)``)."""
    batch_size: int = 4
    """Sequences per step."""
    seed: int = 0
    """Seeds the model's initial weights and the batches."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, ModelConfig):
            raise validate.refuse("model", self.model, "a ModelConfig, or a dict of its fields")
        if self.ON_CORPUS:
            RunConfig(model=self.model)  # the corpus's vocabulary, before anything starts
        validate.whole("batch_size", self.batch_size, low=1)
        validate.whole("seed", self.seed, low=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTTrainingConfig(GPTJobConfig):
    """A GPT job that trains a few AdamW steps and may save what it trained."""

    steps: int = 3
    """AdamW steps."""
    lr: float = 3e-3
    """Learning rate."""
    weight_decay: float = 0.1
    """AdamW's weight decay."""
    grad_clip: float | None = 1.0
    """Gradient-norm clip (None: no clipping)."""
    save: bool = True
    """Write the gradients and parameters the worker's docstring names to the job directory."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate.whole("steps", self.steps, low=1)
        validate.flag("save", self.save)
        self.train_config()  # TrainConfig's own checks

    def train_config(self) -> TrainConfig:
        """The training settings, with ``batch_size`` as the micro-batch."""
        return TrainConfig(micro_batch=self.batch_size, steps=self.steps, lr=float(self.lr),
                           weight_decay=float(self.weight_decay),
                           grad_clip=None if self.grad_clip is None else float(self.grad_clip),
                           seed=self.seed)  # fmt: skip
