"""The capstone job's typed config: its sizes in plain form, its knobs sealed. No torch.

Apart from :mod:`labkit.workers.capstone_train` (which imports torch) so that
:mod:`labkit.course.capstone`, on a layer no lower than the workers', can build the job it
launches without importing the worker.

The knobs (``KNOBS``: the settings of :class:`labkit.course.capstone.Settings`, as the worker
names them) are what a planted fault sets wrong, so the job spec the launcher writes where the
learner can read it must not show them: ``run_job`` puts them in ``sealed``
(:func:`labkit.course.sealed.seal`), and only the sizes stand in plain form. ``settings`` holds
knobs in plain form, for a test's or an instructor's job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from labkit import validate
from labkit.config import ModelConfig
from labkit.course.sealed import seal, unseal
from labkit.jobs.spec import WorkerConfig
from labkit.validate import InvalidValue

SMOKE_MODEL = {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64}
KNOBS: dict[str, Any] = {
    "global_batch": 32, "micro_batch": None, "prepare_data": "once", "loader_workers": 0,
    "no_sync": True,
    "bucket_cap_mb": 25.0, "straggler_s": 0.0, "threads": None, "anomaly_detection": False,
    "eval_every_steps": 0, "activation_checkpointing": False, "sampler": "distributed",
    "set_epoch": True, "zero_grad": True, "dtype": "bfloat16",
    "loss_item_every_micro_batch": False, "optimizer": "default", "pin_memory": True,
    "vocab_size": 320,
}  # fmt: skip
"""Every knob and its healthy value (the worker's module docstring says what each does)."""
SIZES: dict[str, Any] = {"steps": 8, "epoch_steps": 4, "loader_passes": 200, "profile_steps": 2,
                         "checkpoint_every": 8, "eval_batches": 4, "seed": 0, "lr": 1e-3,
                         "model": SMOKE_MODEL}  # fmt: skip
"""The job's size and recipe, which name no fault: the spec may show them."""
DEFAULTS: dict[str, Any] = {**KNOBS, **SIZES}
"""The worker's whole config, flat, with the healthy job's values."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapstoneConfig(WorkerConfig):
    """The capstone job: its sizes, and its knobs in plain form or sealed."""

    WORKER: ClassVar[str] = "labkit.workers.capstone_train"
    steps: int = SIZES["steps"]
    """Optimizer steps."""
    epoch_steps: int = SIZES["epoch_steps"]
    """Steps per epoch: the dataset holds global_batch × epoch_steps windows."""
    loader_passes: int = SIZES["loader_passes"]
    """The cost of tokenising one item (passes over its text)."""
    profile_steps: int = SIZES["profile_steps"]
    """Steps traced by the profiler after the timed ones."""
    checkpoint_every: int = SIZES["checkpoint_every"]
    """Rank 0 saves a checkpoint after every this many steps (0: never), as a DDP job does:
    one rank writes while the others go on to the next all-reduce and wait for it there."""
    eval_batches: int = SIZES["eval_batches"]
    """Batches per validation."""
    seed: int = SIZES["seed"]
    """Seeds the model, the sampler and the data."""
    lr: float = SIZES["lr"]
    """AdamW's learning rate."""
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**SMOKE_MODEL))
    """The GPT (a dict of ModelConfig fields changes SMOKE_MODEL's); the knob ``vocab_size``
    sets its vocabulary."""
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Knobs (names of KNOBS) in plain form."""
    sealed: str | None = None
    """Knobs sealed (:func:`labkit.course.sealed.seal`); they win over ``settings``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = sorted(set(self.knobs()) - set(KNOBS))
        if unknown:
            raise InvalidValue(f"config keys {unknown} are not settings of this job; it has "
                               f"{sorted(DEFAULTS)}")  # fmt: skip
        if not isinstance(self.model, ModelConfig):
            raise validate.refuse("model", self.model, "a ModelConfig, or a dict of its fields")
        for name in ("steps", "epoch_steps", "eval_batches"):
            validate.whole(name, getattr(self, name), low=1)
        for name in ("loader_passes", "profile_steps", "checkpoint_every", "seed"):
            validate.whole(name, getattr(self, name), low=0)
        validate.positive("lr", self.lr)

    def knobs(self) -> dict[str, Any]:
        """The knobs given, plain and sealed (the others keep their KNOBS value)."""
        return {**self.settings, **(unseal(self.sealed) if self.sealed is not None else {})}

    def flat(self) -> dict[str, Any]:
        """The worker's whole config: DEFAULTS under the sizes under the knobs given."""
        sizes = {k: v for k, v in self.to_dict().items() if k in SIZES}
        return {**DEFAULTS, **sizes, **self.knobs()}

    def gpt(self) -> ModelConfig:
        """The GPT the job trains: ``model`` with the vocabulary the knob ``vocab_size`` sets."""
        return dataclasses.replace(self.model, vocab_size=int(self.flat()["vocab_size"]))

    def split(self, world_size: int) -> tuple[int, int]:
        """(sequences per rank, sequences per micro-batch) on ``world_size`` ranks; a global
        batch the ranks cannot share, or a micro-batch that does not divide a rank's share, is
        refused by name."""
        knobs = self.flat()
        g = int(knobs["global_batch"])
        if g % world_size:
            raise InvalidValue(f"global_batch={g} does not split over {world_size} ranks")
        share = g // world_size
        micro = int(knobs["micro_batch"] or max(1, share // 2))
        if share % micro:
            raise InvalidValue(f"micro_batch={micro} does not divide a rank's {share} sequences")
        return share, micro

    @classmethod
    def of(cls, config: CapstoneConfig | Mapping[str, Any]) -> CapstoneConfig:
        """``config`` as a CapstoneConfig: a flat dict's keys sorted into sizes and knobs
        (``settings`` and ``sealed`` taken as they are)."""
        if isinstance(config, CapstoneConfig):
            return config
        given = dict(config)
        fields = {k: given.pop(k) for k in [*SIZES, "sealed"] if k in given}
        return cls(**fields, settings={**given.pop("settings", {}), **given})

    @classmethod
    def sealing(cls, knobs: Mapping[str, Any], **sizes: Any) -> CapstoneConfig:
        """The job with ``knobs`` sealed and ``sizes`` (fields of SIZES, or knobs a caller
        passes in plain form on purpose) plain."""
        return cls.of({**sizes, "sealed": seal(dict(knobs))})
