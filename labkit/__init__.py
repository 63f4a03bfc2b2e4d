"""labkit: the helper package every LLM GPU Lab notebook imports.

Importing labkit (or any of its modules) has no side effects: it starts no threads,
initialises no CUDA context and spawns no processes. Work happens only when a function
is called. (It does add one import finder, :mod:`labkit._moved`, so that the old flat names of
modules that moved into folders still import the moved module.)

The tree, by subsystem:

    top level     the teaching code (``model``, ``train``, ``formulas``, ``memory``,
                  ``precision``...) and the foundations under everything
    formulas/     the closed-form predictions, one module per concern (bytes, FLOPs, the wire)
    memory/       training memory: measured by part, a step's peak predicted, notebook 01's anatomy
    precision/    number formats, underflow, loss scaling, autocast, a step's speed per dtype
    recipes/      mixed-precision recipes: a recipe, one measured step, FSDP2's check, choosing
    planner/      parallel layouts: inputs, the prediction, the search, published checks
    parallel/     one short module per parallel strategy, applied from outside the model
    jobs/         running jobs: launching, the rank's side, processes, failures, checkpoints
    hardware/     what this machine is and can show; the doctor
    metrics/      live hardware metrics, collected (``monitor`` displays them)
    monitor/      live plots of a job's metrics under the cell, and the final figure
    profiling/    traces, phases, overlap, Nsight, planted bottlenecks, HTA
    batching/     batch-size tuning and activation recomputation
    tabular/      the data scientist's models: Dask workers, XGBoost across them, RAPIDS
    roofline/     this machine's measured ceilings
    workers/      the modules every rank of a launched job runs
    recordings/   what real GPUs measured, shipped for learners without one
    course/       the course machinery: exercises, quizzes, the exam, the capstone,
                  learner copies, timings

The map, layer by layer. A module imports only from strictly lower layers: ``tests/
test_layers.py`` reads this table and checks every import in the package against it, between
folders and inside them. A folder named without its modules (``parallel``) is one unit; a
dotted name (``jobs.launch``) is one module of a folder whose modules sit on different layers. A
layer may be a decimal (2.5): a module slotted between two layers.

  layer  unit                  what it is
    -2   errors                LabkitError, the one base of every exception labkit raises
    -2   _moved                the old flat module names, mapped to their folders; a folder's
                               modules imported on first use (``labkit.workers.pp_train``)
    -1   validate              argument checks with one message style, raising errors' classes
    -1   dtypes                the number formats' names, spellings and bytes, in one table
    -1   ids                   how notebooks, exercises and quiz questions are named
    -1   tables                the one HTML table every _repr_html_ builds, each cell escaped
    -1   op_kinds              which kind of work an ATen operator does (matmul, attention...)
    -1   jobs.nodes            where this machine sits in a multi-node job; torchrun's flags
    0    jobs.spec             a job before it runs: a worker's typed config; its folder (no torch)
    0    config                typed, validated configurations and the learner's size presets
    0    timing                timers that own synchronisation, warm-up and repeats
    0    formulas              the closed-form predictions: bytes, FLOPs, communication, MFU
    0    jobs.spawn            the exec wrapper that ties a child's life to its parent's
    0    course.quiz           quiz banks, validated, shown as widgets or text
    0    course.sealed         opaque text for a job spec that its reader should not see plainly
    1    hardware              what this machine is, what it can show, its peaks (sourced table)
    1    hardware.doctor.report  the doctor's verdicts, one item's result, the report it prints
    1    data                  the course corpus, its splits, shards and batches (no network)
    1    jobs.runtime          a rank's side of a job: process group, heartbeats, results
    1    model                 the small GPT every lab trains
    1.5  jobs.diagnosis.evidence         a job's rank logs, and which error messages echo another rank's
    1.5  jobs.diagnosis.tracebacks       a failing rank's traceback, stderr and stack dump, shortened
    1.5  jobs.diagnosis.fingerprints     TORCH_DISTRIBUTED_DEBUG=DETAIL's collective mismatch, read back
    1.5  hardware.doctor.probe  the facts the doctor's checks share (CUDA, NVML, GPUs), read once
    1.7  jobs.diagnosis.hangs            a stalled job: the rank holding it up, where each rank is stuck
    1.7  jobs.diagnosis.collective_ledger  each rank's collectives, recorded, and where two ranks' differ
    2    train                 the one training step and a short loop around it
    2    jobs.procs            process trees of launched jobs, ended cleanly; the job registry
    2    metrics               live hardware metrics (NVML, CPU, network): collection, no display
    2    jobs.diagnosis        which rank caused a failure, how it ended, who merely followed
    2    planner               parallel layouts for a model and a cluster, ranked (modelled)
    2    jobs.slurm            the sbatch script for a course job on a SLURM cluster
    2    hardware.doctor.gpu   the doctor's checks of the GPU stack: build, driver, NVML, links
    2.2  jobs.checkpoint.ranks  a checkpoint's ranks acting together: one choice sent, all outcomes
    2.3  jobs.observers        a running job as a live plot sees it; the observers launch calls
    2.4  jobs.outcome          what a job leaves: JobResult, or the error that says why not
    2.4  jobs.checkpoint.costs  what a checkpoint is made of and costs: bytes, disk speed, save time
    2.5  jobs.preflight        launch's checks before anything starts, and the job's folder
    2.6  jobs.supervisor       a running job: torchrun started, watched, ended with all it began
    2.6  jobs.checkpoint.folders  checkpoints on disk: layout, which can be trusted, the refusals
    2.7  jobs.cli              `labkit launch` on each node, and several nodes rehearsed on one
    2.8  jobs.checkpoint.saving  the atomic checkpoint save: every rank writes, rank 0 renames
    2.8  jobs.checkpoint.loading  resuming: the newest checkpoint that reads whole; resharding
    3    memory                training memory measured in the parts the formulas predict
    3    jobs.launch           one way to run a multi-process job from a cell (torchrun)
    3    verdict               the sentence a measurement chooses, with its spread
    3    precision             number formats, underflow, loss scaling, autocast
    3    roofline              this machine's measured ceilings and kernels placed under them
    3    course.exam           the mock exam over every quiz bank
    3    course.hosted         a hosted notebook's setup: labkit and its pins into the kernel
    3    jobs.checkpoint       atomic DCP checkpoints a restarted job resumes from
    3.5  workers.collective_faults_config  the collective-fault job's config and plan (no torch)
    3.5  workers.capstone_config  the capstone job's config: sizes plain, knobs sealed (no torch)
    4    parallel              data, pipeline, tensor, sequence, context and expert parallelism
    4    monitor               live plots of a job's metrics under the cell
    4    batching              batch-size tuning: what fits, how fast, how large is useful
    4    tabular               Dask workers, XGBoost across them, the bytes per round, RAPIDS
    4    recipes               mixed-precision recipes: bytes per parameter, predicted, measured
    4    fp8                   fp8 casts on real tensors, and fp8 training where it runs
    4    profiling             traces, phases, overlap, memory timelines, Nsight commands, HTA
    4    collective_debug      planted collective bugs, and what each debugging tool says
    4.5  throughput            a run's throughput and MFU; a step's time against the compute roof
    5    workers               the modules every rank of a launched job runs
    5    course.capstone       notebook 07's slow job: faults, seeds, the job, its evidence
    5    recordings            figures and profiles recorded on real GPUs, shipped for everyone
    5.5  hardware.doctor.host  the doctor's checks of the host: versions, CPU, memory, disk, a job
    6    course.exercises      the exercise registry, graded hints and the checks
    6    course.record         record notebook 01's run on a GPU for learners without one
    6    hardware.doctor       is this machine ready for the course?
    7    course.nbgen          the learners' notebooks, generated from the solutions
    7    course.timings        each notebook's run time per section, for a workshop's plan
    7.5  course.book           the rendered course: learners' notebooks executed, as a static site
    8    __main__              the command line: ``python -m labkit <command>``
"""

from labkit import _moved

_moved.install()

__version__ = "0.1.0"
