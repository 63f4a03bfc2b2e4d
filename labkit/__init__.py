"""labkit: the helper package every LLM GPU Lab notebook imports.

Importing labkit (or any of its modules) has no side effects: it starts no threads,
initialises no CUDA context and spawns no processes. Work happens only when a function
is called.

The package, by subsystem. Dependencies point one way, from the bottom of this list to the
top: a module imports only from groups above its own (``tests/test_layers.py`` holds the exact
layers; ``tests/test_package_docs.py`` checks that this map names every module, and only
modules that exist).

Foundations (each imports only foundations listed above it):
    errors            LabkitError, the one base of every exception labkit raises
    validate          argument checks with one message style, raising errors' classes
    dtypes            the number formats' names, spellings and bytes, in one table
    nodes             where this machine sits in a multi-node job; torchrun's flags for it
    ids               how notebooks, exercises and quiz questions are named
    config            typed, validated configurations and the learner's size presets
    timing            timers that own synchronisation, warm-up and repeats
    formulas          the closed-form predictions: bytes, FLOPs, communication, bubbles, MFU
    _spawn            the exec wrapper that ties a child's life to its parent's
    quiz              quiz banks, validated, shown as widgets or text
    sealed            opaque text for a job spec that its reader should not see plainly

The machine, the data, the model, a rank's side of a job:
    hardware          what this machine is, what it can show, its peaks (one sourced table)
    data              the course corpus, its splits, shards and batches (no network)
    dist              a rank's side of a job: process group, heartbeats, results
    model             the small GPT every lab trains
    train             the one training step and a short loop around it
    procs             process trees of launched jobs, ended cleanly; the job registry
    metrics           live hardware metrics (NVML, CPU, network): collection, no display
    diagnosis         which rank caused a failure, how it ended, who merely followed
    planner           parallel layouts for a model and a cluster, ranked (modelled)
    slurm             the sbatch script for a course job on a SLURM cluster

Running and judging jobs:
    launch            one way to run a multi-process job from a cell (torchrun underneath)
    memory            training memory measured in the parts the formulas predict
    verdict           the sentence a measurement chooses, with its spread
    precision         number formats, underflow, loss scaling, autocast
    roofline          this machine's measured ceilings and kernels placed under them
    exam              the mock exam over every quiz bank
    checkpoint        atomic DCP checkpoints a restarted job resumes from

Strategies and tools over jobs:
    parallel          data, pipeline, tensor, sequence, context and expert parallelism,
                      one short module per strategy, applied from outside the model
    monitor           live plots of a job's metrics under the cell
    batching          batch-size tuning: what fits, how fast, how large is useful
    recipes           mixed-precision recipes: bytes per parameter, predicted and measured
    fp8               fp8 casts on real tensors, and fp8 training where it runs
    profiling         traces, phases, overlap, memory timelines, Nsight commands, HTA
    collective_debug  planted collective bugs, and what each debugging tool says

The jobs and what ships with them:
    workers           the modules every rank of a launched job runs
    capstone          notebook 07's slow job: faults, seeds, the job, its evidence
    recordings        figures and profiles recorded on real GPUs, shipped for everyone

What notebooks and instructors call:
    exercises         the exercise registry, graded hints and the checks
    record            record notebook 01's run on a GPU for learners without one
    doctor            is this machine ready for the course?
    nbgen             the learners' notebooks, generated from the solutions
    timings           each notebook's run time per section, for a workshop's plan
    __main__          the command line: ``python -m labkit <command>``
"""

__version__ = "0.1.0"
