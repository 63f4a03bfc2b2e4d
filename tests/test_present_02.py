"""What notebook 02's results print (``labkit.course.exercises.data_parallel.lab``, ``dp_bench``'s
``describe_timed`` and ``plot_bench``, ``dp_strategy.describe_measurements``), on made-up
job results whose every figure is known, and the reconcile checks that must fail."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from labkit import config, formulas
from labkit.course.exercises.data_parallel import bench as dp_bench
from labkit.course.exercises.data_parallel import lab as dp_lab
from labkit.course.exercises.data_parallel import strategy as dp_strategy

N_TRAINABLE = 1024  # 4096 bytes of fp32 gradients
GRAD = 4 * N_TRAINABLE
STEPS = [0.1, 0.020, 0.021, 0.022, 0.023, 0.024]  # the first is warm-up


def _run(name, *, sent, calls, wire=None, spy=False, mem=(4096, 4096, 8192, 8192), loss=None):
    params, grads, opt, acc = mem
    return {
        "loss": loss or [5.5, 4.25],
        "step_s": list(STEPS),
        "timed_with_spy": spy,
        "bytes": {"last_step": {"all_reduce": {"calls": calls}}, "sent_per_rank_last_step": sent,
                  "message_bytes_per_step": [sent, sent], "notes": ["gloo note"] if name == "zero1" else []},
        "bytes_predicted_sent_per_rank": sent,
        "wire": wire,
        "memory": {"parameters": params, "gradients": grads, "optimizer_state": opt,
                   "gradients_accumulating": acc},
        "memory_predicted": {"model_states": params + grads + opt},
    }


def _runs(wire=True):
    def w(bytes_per_rank):  # a quietest step carrying exactly bytes_per_rank on each of 2 ranks
        return {"bytes_per_step": [10**6, 2 * bytes_per_rank + 100, 2 * bytes_per_rank + 500],
                "baseline_per_step": [100, 300]} if wire else None
    return {
        "naive": _run("naive", sent=GRAD, calls=16, wire=w(4500)),
        "bucketed": _run("bucketed", sent=GRAD, calls=2, wire=w(4200)),
        "ddp": _run("ddp", sent=GRAD, calls=2, wire=w(4200)),
        "zero1": _run("zero1", sent=GRAD, calls=2, wire=w(6200), mem=(4096, 4096, 4096, None)),
        "fsdp2": _run("fsdp2", sent=9830, calls=6, wire=w(12000), spy=True,
                      mem=(2048, 2048, 4096, 4096)),
    }


def test_plan_describes_the_jobs_and_refuses_one_rank(monkeypatch):
    p = dp_lab.plan("smoke", gpus=0)
    assert (p.nproc, p.device, p.dtype, p.micro_batch, p.grad_accum, p.steps) == (2, "cpu", "float32", 4, 2, 6)
    assert p.env == {"OMP_NUM_THREADS": "1"} and p.uneven == []
    text = p.describe(tier=False)
    assert text.splitlines()[1] == "size='smoke': 2 ranks on cpu (gloo over loopback), float32"
    assert text.endswith("per rank: 2 micro-batches of 4 x 64 tokens; global batch 16 sequences; "
                         "6 steps per strategy")
    assert p.n_params == formulas.gpt_params(256, 64, 2, seq_len=64)
    assert dp_lab.plan("gpu", gpus=1).describe(tier=False).splitlines()[:2] == [
        "One GPU: data parallelism needs one GPU per rank, so these jobs run on CPU ranks (gloo)",
        "size='gpu' needs 2+ GPUs for these jobs; running size 'lab' on CPU ranks instead"]
    with monkeypatch.context() as m:  # six GPUs, without CUDA here: the autocast dtype is given
        m.setattr(dp_lab.hardware, "default_autocast_dtype", lambda *a: SimpleNamespace(dtype="bfloat16"))
        six = dp_lab.plan("smoke", gpus=6)
    assert (six.nproc, six.device, six.dtype, six.env) == (4, "cuda", "bfloat16", None)
    assert six.describe(tier=False).splitlines()[1] == (
        "size='smoke': 4 ranks on cuda (NCCL), bfloat16; 4 of 6 GPUs, the largest power of two, "
        "so that FSDP2's shards need no padding (set nproc to choose)")
    assert "note: 3 ranks do not divide [256, 64, 64]" in dp_lab.plan("smoke", 3, gpus=0).describe(tier=False)
    with pytest.raises(ValueError, match="needs 2 or more ranks"):
        dp_lab.plan("smoke", 1, gpus=0)
    with pytest.raises(ValueError, match="size='huge' is not allowed"):
        dp_lab.plan("huge", gpus=0)


def test_ladder_prints_the_table_and_checks_the_losses():
    runs = _runs()
    text = dp_lab.ladder(runs, "float32", "cpu").describe().splitlines()
    assert text[1] == ("naive           5.5000 -> 4.2500                   22.0 (21–23)      16"
                       "                 0.004 MiB    0.004 MiB")
    assert text[5].startswith("fsdp2") and "(21–23)*" in text[5]
    assert text[6] == ("(step times over 5 steps per strategy, the first left out; the middle "
                       "half of them lies in the brackets)")
    assert text[-1] == "measured: the five exact strategies' losses differ by at most 0.0e+00 at any step"
    runs["zero1"]["loss"] = [5.5, 4.26]
    with pytest.raises(AssertionError, match="train like the others"):
        dp_lab.ladder(runs, "float32", "cpu")
    assert dp_lab.ladder(runs, "float32", "cuda").describe().endswith("not the CPU's 1e-4")
    assert dp_lab.ladder(runs, "bfloat16", "cuda").tolerance is None


def test_bytes_per_step_on_the_wire_and_counted_only():
    traffic = dp_lab.bytes_per_step(_runs(), nproc=2, n_trainable=N_TRAINABLE, dtype="float32",
                                    grad_accum=2, device="cpu")
    text = traffic.describe().splitlines()
    assert text[0] == ("counted: FSDP2 sent 2.40x DDP's bytes per step (2 micro-batches, 4-byte "
                       "gathers; at most 2.50x if the root were gathered twice too)")
    assert text[5] == "zero1             4.0        4.0         6.0        6.1      1.514      1.009"
    assert "measured: ZeRO-1's wire is 1.51x the ring formula and 1.009x the gloo prediction" in text[9]
    assert text[-1] == "note: gloo note"
    counted = dp_lab.bytes_per_step(_runs(wire=False), nproc=2, n_trainable=N_TRAINABLE,
                                    dtype="float32", grad_accum=2, device="cpu")
    assert "no loopback counters here" in counted.describe()
    assert counted.got("ddp") == "counted 0.004 MiB"
    bad = _runs()
    bad["ddp"]["bytes"]["sent_per_rank_last_step"] = GRAD + 4
    with pytest.raises(AssertionError, match="formula's messages"):
        dp_lab.bytes_per_step(bad, nproc=2, n_trainable=N_TRAINABLE, dtype="float32",
                              grad_accum=2, device="cpu")
    _, ax = plt.subplots()
    dp_lab.plot_bytes(traffic, ax=ax)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "predicted (ring formula)", "predicted for gloo", "measured (loopback)"]
    plt.close("all")


def test_memory_per_rank_and_the_reshard_probe():
    runs = _runs()
    memory = dp_lab.memory_per_rank(runs, n_trainable=N_TRAINABLE, nproc=2, device="cpu")
    text = memory.describe().splitlines()
    assert text[2] == "zero1          0.004     0.004      0.004      0.012      0.012   (no no_sync)"
    assert text[5] == ("measured: FSDP2 between micro-batches holds 0.004 MiB of gradients, 100% of "
                       "all gradients (predicted 100%: unsharded), against 0.002 MiB after the step")
    assert text[7].endswith("2.00 x 4Ψ (fresh .grad beside the buckets)")
    runs["fsdp2"]["memory"]["gradients_accumulating"] = 2048
    with pytest.raises(AssertionError, match="keeps every gradient whole"):
        dp_lab.memory_per_rank(runs, n_trainable=N_TRAINABLE, nproc=2, device="cpu")
    assert dp_lab.reshard_probe(runs, config.preset("smoke").model, n_params=N_TRAINABLE,
                                nproc=2, device="cpu") == (
        "this labkit's FSDP2 has no reshard_after_forward option: no ZeRO-2 row")


class _Job:
    def rank(self, i):
        rows = [{"collective": "all_reduce", "size_bytes": s, "median_s": t, "busbw_GBps": b,
                 "algbw_GBps": b, "emulated": False}
                for s, t, b in ((8, 0.001, 0.01), (2**21, 0.004, 1.02), (2**23, 0.02, 0.9))]
        return {"rows": rows, "link": "gloo over TCP loopback (CPU)"}


def test_collectives_bucket_payoff_and_scaling():
    sweep = dp_lab.collective_sweep(_Job(), 2, "cpu")
    assert sweep.describe() == (
        "measured: smallest all-reduce (8 B) takes 1000 µs: the latency α\n"
        "measured: all-reduce busbw reaches 1.02 GB/s at 2.00 MiB (gloo over TCP loopback (CPU))")
    runs = _runs()
    runs["naive"]["step_s"] = [0.2, 0.08, 0.081, 0.082, 0.083, 0.084]
    text = dp_lab.bucket_payoff(runs, sweep.latency_s).describe().splitlines()
    assert text[1] == ("predicted: naive sends 16 messages per step, bucketed 2, for the same bytes: "
                       "naive pays α 14 more times, about 14.0 ms more per step if nothing overlaps them")
    assert text[-1].startswith("Buckets paid off here: 60.0 ms per step, against 14.0 ms")
    samples = {1: [0.018] * 5, ("strong", 2): [0.0125] * 5, ("weak", 2): [0.0225] * 5}
    scaling = dp_lab.Scaling(samples, dp_lab.world_sizes(2), "cpu")
    text = scaling.describe().splitlines()
    assert text[3] == "  2           12.5      0.72         22.5    0.80"
    assert text[6] == "1 rank            median 18.000 ms, middle half 18.000 ms to 18.000 ms, 5 runs"
    assert scaling.describe_host(SimpleNamespace(usable_cores=1)) == (
        "this host: 1 usable cores for 2 ranks + this kernel\n"
        "more ranks than cores: ranks take turns on a core, so E(n) mostly measures that")
    assert dp_lab.world_sizes(6) == (1, 2, 6)


def test_overlap_node_overlap_compression_and_summary():
    model = config.preset("smoke").model
    samples = {1: [0.018, 0.0182, 0.0181, 0.0179, 0.0183], ("strong", 2): [0.0125] * 5}
    scaling = dp_lab.Scaling(samples, (1,), "cpu")
    hidden = dp_lab.overlap(scaling, sent_per_rank=GRAD, busbw=1e9, model=model, n_params=120_576,
                            micro_batch=4, grad_accum=2, nproc=2, global_batch=16)
    text = hidden.describe().splitlines()
    assert text[2] == ("predicted: the all-reduce takes 0.0 ms per step; the last micro-batch's "
                       "backward lasts 3.0 ms, so 0.0 ms stay exposed if the overlap is perfect")
    assert text[-2] == "verdict: T_1 / 2 is faster than T_2 by 3.450 ms (27.6%)"
    assert text[-1].startswith("So 2 ranks lost 3.4 ms per step to sharing the work")
    node = dp_lab.node_overlap().splitlines()
    assert node[2] == "  512 tokens per micro-batch: r = 3.76    64.8%    31.5%    10.3%"
    assert node[-1] == ("modelled: an 8-GPU H100 node hides the all-reduce from 1,923 tokens per "
                        "micro-batch per GPU (scaling-book: ~2,200 as n grows)")
    comp_runs = {"ddp": _run("ddp", sent=GRAD, calls=2, loss=[5.0, 4.0, 3.0]),
                 "ddp_fp16": _run("x", sent=GRAD // 2, calls=2, loss=[5.0, 4.0, 3.01]),
                 "ddp_bf16": _run("x", sent=GRAD // 2, calls=2, loss=[5.0, 4.1, 3.0])}
    comp = dp_lab.compression(comp_runs, optimizer="adamw", steps=3, device="cpu",
                              hooks=("ddp_fp16", "ddp_bf16"))
    text = comp.describe().splitlines()
    assert text[3] == "ddp_fp16                           0.002     50%      3.0100             0.0100        3"
    assert text[-1] == "ddp_bf16 left fp32 DDP's track: 0.100 apart at step 2 (loss 4.100 against 4.000)"
    with pytest.raises(AssertionError, match="every hook tracks fp32"):
        dp_lab.compression(comp_runs, optimizer="sgd_momentum", steps=3, device="cpu",
                           hooks=("ddp_fp16", "ddp_bf16"))
    plan = dp_lab.plan("smoke", gpus=0)
    runs = _runs()
    summary = dp_lab.Summary(plan, dp_lab.bytes_per_step(runs, nproc=2, n_trainable=N_TRAINABLE,
                                                         dtype="float32", grad_accum=2, device="cpu"),
                             dp_lab.memory_per_rank(runs, n_trainable=N_TRAINABLE, nproc=2, device="cpu"),
                             hidden, dp_lab.Scaling({**samples, ("weak", 2): [0.02] * 5}, (1, 2), "cpu"))
    text = summary.describe().splitlines()
    assert text[2] == ("zero1  bytes/rank/step: measured on the wire 0.006 MiB, predicted 0.004 MiB "
                       "(gloo 0.006);  memory/rank: measured 0.012 MiB, predicted 0.012 MiB")
    assert text[-1] == "scaling at n = 2: E strong 0.72, E weak 0.91 (measured; ideal 1.00)"


def test_runner_up_says_when_there_is_nothing_to_compare():
    runs = _runs()
    runs["fsdp2"]["step_s"] = [0.1, 0.040, 0.041, 0.042, 0.043, 0.044]
    assert dp_lab.runner_up(runs, "zero1", None) == (
        "zero1 is the only strategy that fits: there is no speed to compare")
    text = dp_lab.runner_up(runs, "zero1", "fsdp2").splitlines()
    assert text[2] == "verdict: zero1 step is faster than fsdp2 step by 20.000 ms (47.6%)"
    assert text[3].startswith("(FSDP2's steps were timed with its collective counter running")


def _bench(naive_s):
    samples = {"naive": [naive_s] * 5, "overlap": [0.050] * 5, "bucketed_0.25": [0.010] * 5,
               "bucketed_1": [0.0049] * 5}
    sweep = [{"variant": k, "buckets": b, "measured_s": v[0], "predicted_s": p}
             for (k, v), b, p in zip(samples.items(), (36, 36, 5, 1), (0.0114, 0.0092, 0.0037, 0.0038),
                                     strict=True)]
    return {"samples_s": samples, "sweep": sweep, "forward_s": 0.0013, "backward_s": 0.0022,
            "predicted_exposed_s": {"naive": 0.0079}, "grad_bytes": GRAD, "alpha_s": 1e-4,
            "beta_bytes_per_s": 4.5e9}


def test_dp_bench_describe_timed_and_plot():
    text = dp_bench.describe_timed(_bench(0.0419)).splitlines()
    assert text[3] == "verdict: naive step is faster than overlapped step by 8.100 ms (16.2%)"
    assert text[-2] == ("naive: 1067 µs per message measured beyond forward and backward, 219 µs "
                        "predicted from the bare all-reduces' α and β")
    assert text[-1].startswith("The model prices only the all-reduce itself.")
    assert dp_bench.describe_timed(_bench(0.0114)).splitlines()[-1].startswith("Within 20% of the model")
    _, ax = plt.subplots()
    dp_bench.plot_bench(_bench(0.0419), "cpu", ax=ax)
    assert ax.get_title() == "one step, 2 ranks on cpu" and len(ax.get_lines()) == 4
    plt.close("all")


def test_describe_measurements():
    measured = {"ddp": {"step_s": 0.017, "after_step_bytes": 1.84 * 2**20,
                        "accumulating_bytes": 2.3 * 2**20, "predicted_bytes": 1.84 * 2**20, "ranks": 2},
                "zero1": {"step_s": 0.0146, "after_step_bytes": 1.38 * 2**20,
                          "accumulating_bytes": None, "predicted_bytes": 1.38 * 2**20, "ranks": 2}}
    assert dp_strategy.describe_measurements(measured, 1.84 * 2**20) == "\n".join([
        "budget: 1.840 MiB of model states per rank (ZeRO's formula for DDP in this job: modelled)",
        "strategy    step (ms)  after a step  accumulating  predicted   (MiB per rank, 2 ranks; "
        "step and bytes measured, predicted modelled)",
        "ddp              17.0         1.840         2.300      1.840",
        "zero1            14.6         1.380     (= after)      1.380"])


def test_a_slower_bucketed_step_is_explained_only_on_the_tier_that_explains_it():
    runs = _runs()
    runs["bucketed"]["step_s"] = [0.2, 0.15, 0.151, 0.152, 0.153, 0.154]
    runs["naive"]["step_s"] = [0.2, 0.08, 0.081, 0.082, 0.083, 0.084]
    on_cpu = dp_lab.bucket_payoff(runs, 1e-3, "cpu").describe()
    on_gpu = dp_lab.bucket_payoff(runs, 1e-3, "cuda").describe()
    assert "gloo threads" in on_cpu and "gloo" not in on_gpu
    assert "which this run does not explain" in on_gpu
