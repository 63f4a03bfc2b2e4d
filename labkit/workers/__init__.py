"""Worker modules: each runs on every rank of a job started by ``labkit.jobs.launch.run``.

Workers must be importable modules (not functions in a notebook): torchrun starts fresh
Python processes, which can import a module but cannot reach into the notebook's memory.

    allreduce    the first 2-process job: one all-reduce, checked, then timed (notebook 00)
    allreduce_sizes  all-reduces of a few sizes timed in turns, every sample kept (notebook 00's plan)
    collectives  all-reduce, all-gather, reduce-scatter timed over message sizes (notebook 02)
    dp_train     data-parallel training with a chosen strategy, bytes and memory counted (02)
    pp_train     pipeline schedules (naive, GPipe, 1F1B, torch's) with per-micro-batch timelines (03)
    tp_train     tensor-parallel layers and GPT (Megatron f/g, and DTensor), bytes counted (03)
    _faults      misbehaving workers for the launcher's tests (raise, hang, ignore SIGTERM)

The exercise checks' own workers live with the checks (``labkit.course.exercises.dp_worker`` and
``mp_worker``): workers here know nothing of exercises.
"""
