"""The job as notebook 07 hands it out, in words: its code, where its ranks run, what the tier
leaves out of the catalogue, and why.

    device, tier = capstone.placement(nproc)
    print(capstone.describe_handout(code, nproc=nproc, device=device, tier=tier, size="smoke"))

It names the job code and the tier's left-out faults (public: :data:`~labkit.course.capstone.FAULTS`'
``why_not``), never a fault the code plants.
"""

from __future__ import annotations

from labkit.course.capstone.faults import describe_left_out


def describe_handout(code: str, *, nproc: int, device: str, tier: str, size: str,
                     gpus: int | None = None) -> str:  # fmt: skip
    """What the learner is told of the job of ``code``: its ranks, device, tier and size, to keep
    the code, how its key is opened (and that the record says so), the faults ``tier`` never
    plants, and, when ``nproc`` ranks run on the CPU beside one GPU, why. ``gpus``: the visible
    GPU count, asked of torch when None (without creating a CUDA context)."""
    parts = [f"Your job: {code}, {nproc} ranks on {device} ({tier} tier), size {size!r}.\n"
             "Keep the code to run the same job again. Your instructor holds its answer key; "
             "without one, `python -m labkit capstone reveal --give-up` opens it, and your "
             "record says so."]  # fmt: skip
    left_out = describe_left_out(tier)
    if left_out:
        parts.append(left_out)
    if device == "cpu":
        if gpus is None:
            from labkit.jobs import launch

            gpus = launch.visible_gpu_count()
        if gpus == 1:
            parts.append(f"One GPU and {nproc} ranks: the job's ranks run on the CPU over gloo "
                         "(NCCL needs a GPU per rank), so the GPU-only faults are not planted.")  # fmt: skip
    return "\n\n".join(parts)
