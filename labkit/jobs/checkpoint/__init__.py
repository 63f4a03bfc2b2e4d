"""Checkpoints that survive a crash: written atomically, loaded only when complete.

    from labkit.jobs import checkpoint
    state = checkpoint.load_latest(root, model, optimizer)    # None: start from scratch
    start = state.step if state else 0
    for step in range(start, steps):
        ...train one step...
        if (step + 1) % every == 0:
            checkpoint.save(root, step + 1, model, optimizer, extra={"data_position": step + 1})

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP): every rank calls
``save`` and ``load`` together, each rank writes a share of the tensors (DCP gives each
replicated tensor to one rank, balancing the bytes) and reads what it needs, and a sharded
model (FSDP2's DTensors) is saved shard by shard. The model's DDP wrapper, if any, is seen
through (``get_state_dict`` names parameters without ``module.``).

What DCP does not know goes into one small file per rank, ``rank{r}.pt``: the step, the
caller's ``extra`` (the data position) and the random-number generators' states. A file per
rank, not a DCP key, because these values differ from rank to rank (each rank's dropout
stream is its own) and DCP treats a plain tensor that every rank saves under one key as
replicated: it keeps one rank's copy (``dedup_save_plans``), and the others' would be lost.

Layout under ``root``::

    step000000012/          a complete checkpoint: the only kind ever loaded
        .metadata           DCP's index of the tensors
        __0_0.distcp ...    DCP's data, one file per rank that wrote some
        rank0.pt rank1.pt   per-rank state: step, extra, RNG
        manifest.json       written last: step, world size, the model's parameter names,
                            shapes and dtypes, every other file's bytes, seconds
    .tmp-step000000014/     a checkpoint being written (or one whose writer died)
    .replaced-step000000012/  the old step 12 while a save replaces it (a restart that went
                            back past it); removed once the new one is in place

Atomic: every rank writes into the temporary folder; after a barrier (every rank done), rank 0
writes the manifest and renames the folder to its final name, one ``rename``, which POSIX
makes atomic. A reader therefore sees a whole checkpoint or none, and a job killed at any
moment leaves at worst a ``.tmp-`` folder that is never loaded. Replacing a step renames the
old folder aside first and removes it only after the new one is in place, so a crash between
the two leaves the old one, which the next ``load_latest`` or ``save`` puts back. All ranks
must see the same ``root``: on several machines, a shared file system.

Damage is named, never loaded and never fatal while an older checkpoint is whole: a checkpoint
whose files are cut short (the manifest records their sizes), whose manifest holds odd fields,
or that torch cannot read is skipped with a ``CheckpointWarning`` for the previous complete one.
A save that fails (a full disk) raises a ``CheckpointError`` on every rank (the same facts on
each, naming that rank's folder), removes its temporary folder and leaves the previous
checkpoints as they were.

This module is the one to import; the work is done in five modules, one concern each:

    ranks                how the ranks act together: rank 0's choice sent, every outcome gathered
    costs                what a checkpoint is made of and costs: bytes predicted, disk speed,
                         sync against async save time
    folders              the layout on disk, which folders can be trusted, the errors that refuse
    saving               the atomic save: write, agree, publish with one rename
    loading              resuming: the newest complete checkpoint that reads whole; resharding
"""

from __future__ import annotations

from labkit.jobs.checkpoint.costs import METADATA_BYTES_PER_TENSOR as METADATA_BYTES_PER_TENSOR
from labkit.jobs.checkpoint.costs import count as count
from labkit.jobs.checkpoint.costs import optimizer_kind as optimizer_kind
from labkit.jobs.checkpoint.costs import predict_bytes as predict_bytes
from labkit.jobs.checkpoint.costs import signature as signature
from labkit.jobs.checkpoint.costs import tensor_overhead_bytes as tensor_overhead_bytes
from labkit.jobs.checkpoint.costs import time_save_modes as time_save_modes
from labkit.jobs.checkpoint.costs import write_bandwidth as write_bandwidth
from labkit.jobs.checkpoint.folders import FORMAT as FORMAT
from labkit.jobs.checkpoint.folders import MANIFEST as MANIFEST
from labkit.jobs.checkpoint.folders import MAX_STEP as MAX_STEP
from labkit.jobs.checkpoint.folders import CheckpointError as CheckpointError
from labkit.jobs.checkpoint.folders import CheckpointMismatch as CheckpointMismatch
from labkit.jobs.checkpoint.folders import CheckpointWarning as CheckpointWarning
from labkit.jobs.checkpoint.folders import final_dir as final_dir
from labkit.jobs.checkpoint.folders import mismatches as mismatches
from labkit.jobs.checkpoint.folders import read_manifest as read_manifest
from labkit.jobs.checkpoint.folders import scan as scan
from labkit.jobs.checkpoint.folders import shares as shares
from labkit.jobs.checkpoint.folders import tmp_dir as tmp_dir
from labkit.jobs.checkpoint.loading import MAX_LINES as MAX_LINES
from labkit.jobs.checkpoint.loading import Loaded as Loaded
from labkit.jobs.checkpoint.loading import load_latest as load_latest
from labkit.jobs.checkpoint.loading import load_resharded as load_resharded
from labkit.jobs.checkpoint.saving import Saved as Saved
from labkit.jobs.checkpoint.saving import save as save
