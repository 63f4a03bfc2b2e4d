"""Parallelism applied from outside the model, one short module per strategy.

The model (:mod:`labkit.model`) knows nothing about ranks; each module here adds one way of
splitting the work, as torchtitan's ``parallelize.py`` and picotron's per-axis files do.

Data parallelism (notebook 02), every strategy behind the same small interface
(:class:`labkit.parallel.dp_config.Strategy`: ``wrap``, ``optimizer``, ``no_sync``,
``after_backward``, ``bytes_counter``, ``memory``):

    dp_naive      all-reduce every gradient once backward has finished, then average
                  (every strategy first broadcasts rank 0's weights, as DDP does)
    dp_bucketed   gradient hooks fill buckets; asynchronous all-reduces overlap backward
    ddp           torch's DistributedDataParallel, with no_sync and communication hooks
                  (fp16/bf16 compression, PowerSGD)
    zero1         optimizer state sharded across ranks (ZeRO stage 1), written from scratch
    fsdp          torch's FSDP2 ``fully_shard`` over an explicit device mesh (ZeRO stage 3), on
                  any nn.Module (units named by a list or a policy), with bf16 mixed
                  precision and ``reshard_after_forward`` as options
    comm          counted collectives: the bytes each strategy sends, by kind of collective
    dp_config     the shared interface, and the checks a data-parallel config passes before
                  any process starts

Pipeline and tensor parallelism (notebook 03; schedules and debugging in notebook 03d):

    pipeline      the GPT cut into stages, one per rank, micro-batches streamed through
                  them (GPipe, 1F1B, interleaved), also over a mesh's "pp" dimension
    pipeline_plan  what is decided before a pipeline runs: its checks, the cut into
                  stages, the bytes a data-parallel group of stages sends
    pipeline_p2p  the point-to-point plan: each rank's send/receive batches, deadlock check
    schedules     pipeline schedules as plain lists of actions, and an ideal-clock simulator
    timeline      each rank's timeline of a pipeline step: the bubble measured, the Gantt chart
    tensor        every layer's matrices split across ranks, Megatron-LM's f and g

Composing them (notebook 03b; sequence, context and expert parallelism in notebook 03c), each
strategy taking its process group from a named dimension of a device mesh:

    mesh          named device meshes: validated before any process group exists, each
                  rank's group along a dimension (row-major, as init_device_mesh), the bytes
                  per rank on each dimension and the memory per rank predicted, and MeshSpy,
                  which counts collectives by the dimension whose group carried them
    compose       FSDP2 x tensor parallelism on a ("dp", "tp") mesh and HSDP on a
                  ("replicate", "shard") mesh, torchtitan's order
    sequence      sequence parallelism (Korthikanti et al. 2022) from scratch, and DTensor's
    sequence_costs  its config check, activation bytes (the paper's Table 2 and ours) and
                  collectives predicted, and what autograd saves measured
    context       context parallelism: ring attention with the online-softmax merge
    expert        a mixture of experts, experts on ranks, tokens sent all-to-all
    expert_report  its bytes predicted, counted and measured per rank, the load per expert,
                  the auxiliary loss's effect: notebook 03c's readings and figures

This file imports nothing on purpose: each module is imported where it is used, so importing
one strategy never pulls in another. ``parallel.pipeline``, after ``from labkit import
parallel``, imports that one module when first named.
"""

from labkit._moved import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)  # parallel.pipeline: imported when first named
