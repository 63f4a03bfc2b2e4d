"""Worker modules: each runs on every rank of a job started by ``labkit.jobs.launch.run``.

Workers must be importable modules (not functions in a notebook): torchrun starts fresh
Python processes, which can import a module but cannot reach into the notebook's memory.
Each declares its settings as a frozen dataclass (``allreduce.AllReduceConfig``, a
``labkit.jobs.spec.WorkerConfig``), checked when it is built, and one ``run(config, nproc=...)``;
every rank reads the same dataclass back from ``ctx.config``.

    allreduce          the first 2-process job: one all-reduce, checked, then timed (notebook 00)
    allreduce_sizes    all-reduces of a few sizes timed in turns, every sample kept (notebook 00's
                       plan)
    allreduce_report   notebook 00's reading of the first job in the kernel: values, bytes, time
    multinode_report   notebook 02b's reading of a rehearsal of several nodes: places, sums, weights
    resilient_report   notebook 02b's reading of a job killed and resumed: lost steps, restart,
                       saves
    collectives        all-reduce, all-gather, reduce-scatter timed over message sizes (notebook 02)
    dp_train           data-parallel training with a chosen strategy, bytes and memory counted (02)
    pp_train           pipeline schedules (naive, GPipe, 1F1B, torch's) with per-micro-batch
                       timelines (03)
    tp_train           tensor-parallel layers and GPT (Megatron f/g, and DTensor), bytes counted
                       (03)
    mesh_report        notebook 03b's reading of the mesh job: groups, bytes, parity, memory, step
                       times
    dp_pp_report       notebook 03b's data × pipeline section: prediction, counts, parity, timeline
    job_config         what the configs share: the small GPT's fields and their checks (no torch)
    collective_faults_config  the collective-fault job's config and plan, for collective_debug on a
                       lower layer (no torch)
    capstone_config    the capstone job's config, its knobs sealed, for course.capstone on a layer
                       no lower than the workers' (no torch)
    _faults            misbehaving workers for the launcher's tests (raise, hang, ignore SIGTERM)
    capstone_train     the capstone's job: data-parallel training of the course GPT, every knob of
                       it a setting
    collective_faults  three classic collective bugs, planted one at a time on rank 1 of a 2-rank
                       job
    cp_attention       ring attention on n ranks: parity with full attention, bytes counted, memory
                       and time
    dp_profile         a data-parallel job that profiles itself: one Chrome trace per rank, per run
    mesh_train         two-dimensional parallelism on 4 ranks: a mesh's groups, FSDP2 × TP, and HSDP
    moe_train          expert parallelism: a mixture-of-experts layer split over the ranks, checked
                       and counted
    multinode          a job of several machines in miniature: where each rank runs, one all-reduce,
                       one DDP step
    pp_compose         pipelines composed: data × pipeline on a 2-D mesh, and torch's multi- stage
                       schedules
    resilient_train    train through a failure: checkpoint every few steps, lose a rank, restart,
                       resume
    sp_train           sequence-parallel GPT (tensor × sequence parallelism on one group): ours and
                       DTensor's, against plain tensor parallelism

The exercise checks' own workers live with the checks (``labkit.course.exercises.data_parallel.worker`` and
``model_parallel.worker``): workers here know nothing of exercises.

Nothing is imported up front (a rank imports only its own worker); a notebook writes ``from
labkit import workers`` and then ``workers.pp_train.run(...)``, which imports ``pp_train`` there.
"""

from labkit._moved import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # workers.pp_train: imported when first named
