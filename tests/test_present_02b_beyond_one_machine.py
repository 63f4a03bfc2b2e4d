"""Notebook 02b's presentation, moved out of its cells: each function prints what the cell printed
before, for a given input (launch.describe_rehearsal and cli.describe_rehearsal_plan,
multinode_report.predict / describe_rehearsal / reconcile, formulas.multinode_allreduce_sweep and
plot_multinode_allreduce, slurm.describe_sbatch_here, and resilient_report: build, forecast,
compare, Resumed.describe / describe_reshard / restart_s, plot_resume, describe_save_modes,
plan_checkpoints)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import matplotlib
import pytest
import torch

from labkit import formulas
from labkit.jobs import cli, launch, slurm
from labkit.workers import multinode, multinode_report
from labkit.workers import resilient_report as report

matplotlib.use("Agg")


# --- section 0: where a rehearsal runs --------------------------------------------------------


def test_the_rehearsal_plan_says_where_the_ranks_run_and_what_one_machine_shows():
    lines = cli.describe_rehearsal_plan(2, 1, 0).splitlines()
    assert lines[0] == "2 nodes x 1 rank(s) = 2 ranks, every rank on the CPU over gloo"
    assert lines[1].startswith("What a rehearsal on one machine shows for real: the rendezvous")
    assert lines[-1] == ("What it cannot: a network between machines (the agents talk over this "
                         "machine's loopback or GPU links).")  # fmt: skip
    assert len(lines) == 4
    assert cli.describe_rehearsal_plan(2, 2, 1).splitlines()[0] == (
        "2 nodes x 2 rank(s) = 4 ranks, every rank on the CPU over gloo (this machine has 1 "
        "GPU(s), fewer than the 4 ranks)")
    assert cli.describe_rehearsal_plan(2, 2, 8).splitlines()[0] == (
        "2 nodes x 2 rank(s) = 4 ranks, each agent shown its own 2 of this machine's 8 GPU(s)")


def test_launch_describes_the_rehearsal_with_this_machines_gpu_count(monkeypatch):
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 4)
    assert launch.describe_rehearsal(2, 2).startswith("2 nodes x 2 rank(s) = 4 ranks, each agent")
    with pytest.raises(ValueError, match="nodes"):
        launch.describe_rehearsal(0, 1)


# --- section 1: predict, measure, reconcile ---------------------------------------------------


def test_the_prediction_numbers_ranks_node_by_node():
    p = multinode_report.predict(2, 2)
    assert p.describe().splitlines() == [
        "node 0: ranks [0, 1]  (predicted)",
        "node 1: ranks [2, 3]  (predicted)",
        "all-reduce of rank + 1 over 4 ranks: 10 on every rank (predicted)",
    ]
    assert torch.equal(p.reference, multinode.reference_params(4))


def rehearsal(tmp_path, prediction, *, nodes=(0, 1), sums=(3.0, 3.0), shift=0.0):
    """A rehearsal of two nodes of one rank each, as launch.rehearse_nodes returns it: node 1
    ran in the background and printed one line."""
    log = tmp_path / "agent1.log"
    log.write_text("noise\n[node1 rank1] rank 1 is local rank 0 of node 1 (vm)\n")
    params = (prediction.reference + shift).tolist()
    records = [{"node_rank": k, "status": "ok", "wall_s": 5.0 - k,
                "results": {str(k): {"node_rank": nodes[k], "local_rank": 0, "host": "vm",
                                     "allreduce": sums[k], "params": params}}}
               for k in range(2)]  # fmt: skip
    records[1]["agent_log"] = str(log)
    return cli.Rehearsal(records, SimpleNamespace(node_rank=0), "torchrun ... -m labkit.workers.multinode")


def test_the_rehearsal_shows_each_rank_the_agents_and_the_command(tmp_path):
    p = multinode_report.predict(2, 1)
    text = multinode_report.describe_rehearsal(p, rehearsal(tmp_path, p))
    assert text.splitlines() == [
        "(this kernel's agent got node rank 0)",
        "[node1 rank1] rank 1 is local rank 0 of node 1 (vm)",
        "",
        "rank  node  local rank       host  all-reduce  max |w - one process|",
        "   0     0           0         vm           3               0.00e+00",
        "   1     1           0         vm           3               0.00e+00",
        "(all measured) each node's agent: node 0 ok in 5.0 s, node 1 ok in 4.0 s",
        "",
        "this rehearsal's agents each ran:",
        "  torchrun ... -m labkit.workers.multinode",
    ]


def test_the_reconcile_agrees_when_the_ranks_hold_the_prediction(tmp_path):
    p = multinode_report.predict(2, 1)
    assert multinode_report.reconcile(p, rehearsal(tmp_path, p)).describe().splitlines() == [
        "ranks on the predicted nodes: yes  ({0: 0, 1: 1})",
        "all-reduce: every rank holds [3.0], predicted 3: agree",
        "after one DDP step the 2 ranks' weights are bitwise identical, and 0.0e+00 from one "
        "process's step on all batches (rounding: the mean is summed in another order)",
    ]


def test_the_reconcile_names_a_misplaced_rank_a_wrong_sum_and_weights_too_far(tmp_path):
    p = multinode_report.predict(2, 1)
    lines = multinode_report.reconcile(p, rehearsal(tmp_path, p, nodes=(0, 0), sums=(3.0, 2.0),
                                             shift=0.5)).describe().splitlines()  # fmt: skip
    assert lines[0] == "ranks on the predicted nodes: NO  ({0: 0, 1: 0})"
    assert lines[1] == "all-reduce: every rank holds [2.0, 3.0], predicted 3: DISAGREE"
    assert lines[2].endswith("bitwise identical, and 5.0e-01 from one process's step on all "
                             "batches (too far: a bug)")  # fmt: skip


# --- section 2: the all-reduce across nodes, modelled -----------------------------------------


def test_the_sweep_tables_flat_and_two_level_times():
    sweep = formulas.multinode_allreduce_sweep(16e9, 8, [1, 2, 64], intra_bytes_per_s=450e9,
                                               inter_bytes_per_s=50e9)  # fmt: skip
    assert sweep.describe().splitlines() == [
        "all-reduce of 16 GB over nodes of 8 GPUs (modelled, seconds)",
        "nodes  GPUs  flat ring     two-level",
        "    1     8      0.062         0.062",
        "    2    16      0.600         0.102",
        "   64   512      0.639         0.141",
        "",
        "one node (NVLink only): 0.062 s; the first network hop makes the flat ring 9.6x slower, "
        "the two-level one 1.64x (the NVLink to network ratio is 9x); at 64 nodes the two-level "
        "one is 2.3x one node's time, the flat ring 10.3x",
    ]
    assert sweep.two_level_s[1] == formulas.multinode_allreduce_time(
        16e9, 2, 8, intra_bytes_per_s=450e9, inter_bytes_per_s=50e9, hierarchical=True)


@pytest.mark.parametrize("counts", [[2, 4], [1], [1, 4, 4]])
def test_the_sweep_needs_rising_node_counts_from_one(counts):
    with pytest.raises(ValueError, match="rising node counts from 1"):
        formulas.multinode_allreduce_sweep(1e9, 8, counts, intra_bytes_per_s=1e9,
                                           inter_bytes_per_s=1e9)  # fmt: skip


def test_the_sweep_plot_draws_both_lines_against_gpus():
    sweep = formulas.multinode_allreduce_sweep(16e9, 8, [1, 2, 4], intra_bytes_per_s=450e9,
                                               inter_bytes_per_s=50e9)  # fmt: skip
    ax = formulas.plot_multinode_allreduce(sweep)
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[8, 16, 32]] * 2
    assert ax.get_title() == ("all-reduce of 16 GB of gradients: NVLink 450 GB/s, network 50 GB/s "
                              "per GPU")  # fmt: skip
    assert ax.get_xlabel() == "GPUs (8 per node)"
    matplotlib.pyplot.close(ax.figure)


# --- section 3: the scheduler -----------------------------------------------------------------


def test_the_sbatch_line_says_whether_this_machine_can_queue_the_script():
    assert slurm.describe_sbatch_here(lambda _: "/usr/bin/sbatch") == (
        "this machine: SLURM's sbatch is at /usr/bin/sbatch: `python -m labkit slurm ... -o "
        "multinode.sbatch` writes this script to a file and `sbatch multinode.sbatch` queues it")
    assert slurm.describe_sbatch_here(lambda _: None) == (
        "this machine: no sbatch here; the course's tests submit such a script to a one-node "
        "SLURM cluster (tests/test_slurm.py) and check every rank's output")


# --- section 4: killed, resumed, resharded, saved, planned ------------------------------------


def forecast(model=None):
    model = model or torch.nn.Linear(10, 10)  # 110 parameters
    predicted = {"bytes": 2000, "payload_bytes": 1320, "method": "predicted: 12 B/param"}
    return report.forecast(model, predicted, 1e6, kill_rank=1, kill_at_step=10, every=4)


def test_build_gives_the_jobs_gpt_with_the_fields_over_the_default_and_an_adamw():
    model, opt = report.build({"d_model": 32})
    assert model.cfg.d_model == 32 and model.cfg.n_layer == 2 and model.cfg.dropout == 0.1
    assert type(opt).__name__ == "AdamW"


def test_the_forecast_gives_bytes_disk_speed_save_time_and_lost_steps():
    assert forecast().describe().splitlines() == [
        "model: 110 parameters",
        "predicted checkpoint: 2,000 B (predicted: 12 B/param)",
        "measured: this disk writes 1 MB/s (one fsync'd write of that size)",
        "predicted save time, disk only: 2.0 ms",
        "predicted: rank 1 killed after step 10, checkpoints every 4 steps: the last one holds "
        "step 8, 2 steps lost and trained again",
    ]


def resumed(*, clean_shift=0.0, again_loss=2.0, events=True):
    w = {"a": torch.ones(3), "b": torch.zeros(2)}
    killed = {"attempts": 2, "lost_steps": 2, "lost_steps_predicted": 2, "resumed_from_step": 8,
              "steps": 12, "checkpoint": {"bytes": 2200, "seconds": 0.02}}  # fmt: skip
    losses = [{"step": s, "loss": 2.0, "attempt": 1} for s in (9, 10)]
    losses += [{"step": s, "loss": again_loss, "attempt": 2} for s in (9, 10, 11, 12)]
    kill = [{"event": "kill", "rank": 1, "attempt": 1, "time": 100.0}]
    stages = [("process_start", 100.5), ("pg_up", 101.5), ("checkpoint_loaded", 103.0),
              ("first_step", 103.25)]  # fmt: skip
    later = [{"event": e, "rank": 0, "attempt": 2, "time": t} for e, t in stages]
    return report.Resumed(killed, {}, losses, [], kill + (later if events else []), w,
                          {n: t + clean_shift for n, t in w.items()}, forecast())  # fmt: skip


def test_a_resumed_job_is_told_against_its_forecast_and_the_clean_job():
    r = resumed()
    assert r.describe().splitlines() == [
        "attempts: 2 (one restart); lost steps: measured 2, predicted 2: agree",
        "the 2 lost steps, trained twice, gave the same loss both times: yes, bitwise",
        "final weights of the killed-and-resumed job vs the uninterrupted one: bitwise identical "
        "(2 tensors)",
        "checkpoint size: measured 2,200 B, predicted 2,000 B (+10.0%); of which 12 B/param: "
        "1,320 B",
        "save time: measured 20 ms on rank 0 (the last save, one sample), predicted 2.2 ms for "
        "the disk alone: 9.1x",  # the measured checkpoint's bytes at the disk's speed
        "",
        "from the kill, one restart (measured, one clock on this machine):",
        "  +  0.50 s  new rank 0 started: failure seen, old ranks stopped, agents met again",
        "  +  1.50 s  its process group up: torch imported, init_process_group",
        "  +  3.00 s  the checkpoint loaded",
        "  +  3.25 s  its first step done",
        "the longest part of this restart (one sample): 'the checkpoint loaded', 1.50 of 3.25 s",
    ]
    assert r.restart_s == 3.25


def test_a_resume_that_drifted_says_how_far_and_a_missing_timeline_has_no_restart():
    lines = resumed(clean_shift=1e-6, again_loss=2.5, events=False).describe().splitlines()
    assert lines[1].endswith("gave the same loss both times: to 5.0e-01")
    assert lines[2].endswith("uninterrupted one: within rounding (max |diff| 1.0e-06) (2 tensors)")
    assert lines[-1] == "from the kill, one restart (measured, one clock on this machine):"
    assert resumed(events=False).restart_s is None
    far = resumed(clean_shift=0.1).describe().splitlines()[2]
    assert far.endswith("DIFFERENT (max |diff| 1.0e-01): the resume lost some state (2 tensors)")


def test_compare_reads_both_jobs_files(tmp_path):
    def job(name, params):
        (tmp_path / f"{name}.losses").write_text(json.dumps({"step": 1, "loss": 1.0, "attempt": 1}) + "\n")
        (tmp_path / f"{name}.events").write_text("")
        torch.save(params, tmp_path / f"{name}.pt")
        return SimpleNamespace(result={"losses_file": str(tmp_path / f"{name}.losses"),
                                       "events_file": str(tmp_path / f"{name}.events"),
                                       "final_params": str(tmp_path / f"{name}.pt")})  # fmt: skip

    r = report.compare(job("k", {"w": torch.ones(2)}), job("c", {"w": torch.zeros(2)}), forecast())
    assert r.losses == r.clean_losses == [{"step": 1, "loss": 1.0, "attempt": 1}]
    assert torch.equal(r.final_params["w"], torch.ones(2))
    assert torch.equal(r.clean_params["w"], torch.zeros(2))


def test_the_resume_plot_marks_each_checkpoint_and_shades_the_lost_steps():
    ax = report.plot_resume(resumed())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "the same job, never killed (measured)", "attempt 1 (killed)",
        "attempt 2 (after the restart)", "steps lost: 2 (trained twice)"]
    dotted = [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert dotted == [4, 8, 12]
    matplotlib.pyplot.close(ax.figure)


def test_a_reshard_says_what_it_read_and_whether_the_weights_are_the_jobs():
    model = torch.nn.Linear(2, 1)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    r = report.Resumed({}, {}, [], [], [], final, final, forecast())
    opt = torch.optim.AdamW(model.parameters())
    loaded = {"files": {"__0_0.distcp": 1234, "__1_0.distcp": 99}, "saved_by": 2, "loaded_by": 1}
    assert r.describe_reshard(loaded, model, opt).splitlines() == [
        "files it read (measured bytes): __0_0.distcp 1,234 B, __1_0.distcp 99 B",
        "saved by 2 ranks, loaded by 1: the weights are bitwise equal to the job's final weights "
        "(as predicted); optimizer state for 0 parameters restored",
    ]
    with torch.no_grad():
        model.bias += 1
    assert "NOT equal to the job's final weights: read why" in r.describe_reshard(loaded, model, opt)


def test_the_save_modes_give_each_kinds_spread_and_the_verdict():
    modes = {"bytes": 1786413, "sync_s": [0.020, 0.022, 0.021, 0.023, 0.022],
             "async_blocking_s": [0.004, 0.0035, 0.0038, 0.0041, 0.0039],
             "async_total_s": [0.026, 0.027, 0.025, 0.026, 0.028]}  # fmt: skip
    lines = report.describe_save_modes(modes).splitlines()
    assert lines[:4] == [
        "one save: 1,786,413 B (measured); 5 rounds, each kind in turn",
        "  dcp.save: training waits for the whole write               median    22.0 ms (min "
        "20.0, max 23.0)",
        "  dcp.async_save: training waits until it returns (staging)  median     3.9 ms (min "
        "3.5, max 4.1)",
        "  dcp.async_save: until the background write finished        median    26.0 ms (min "
        "25.0, max 28.0)",
    ]
    assert lines[-1].startswith("verdict: async_save's blocking time is faster than a "
                                "synchronous save")  # fmt: skip


def young(blocking_s, restart_s, mtbf_s):
    tau = math.sqrt(2 * blocking_s * mtbf_s)
    return tau, blocking_s / tau + (tau / 2 + restart_s) / mtbf_s


def test_the_plans_apply_the_learners_function_to_each_save():
    modes = {"sync_s": [0.02, 0.02, 0.02], "async_blocking_s": [0.005, 0.005, 0.005]}
    plans = report.plan_checkpoints(young, modes, 3.0, 3600.0, mtbf_source="one an hour")
    assert plans.describe().splitlines() == [
        "(mean time between failures: 1.0 h, one an hour; restart 3.0 s, measured above)",
        "synchronous save (measured median): δ = 0.02 s -> every 0.2 min (Daly: 0.2 min), losing "
        "0.42% of the time, of which the restarts 0.08% (predicted)",
        "asynchronous save, its blocking part (measured median): δ = 0.005 s -> every 0.1 min "
        "(Daly: 0.1 min), losing 0.25% of the time, of which the restarts 0.08% (predicted)",
        "a large model's synchronous save, 60 s (assumed), 10 min restart (assumed): δ = 60 s -> "
        "every 11.0 min (Daly: 10.3 min), losing 34.92% of the time, of which the restarts "
        "16.67% (predicted)",
        "",
        "With the asynchronous save's shorter stop, the plan saves 2.0x as often and loses 0.17% "
        "less of the time (predicted from measured δ and R).",
    ]
    slower = {"sync_s": [0.005], "async_blocking_s": [0.02]}
    text = report.plan_checkpoints(young, slower, None, 3600.0, mtbf_source="x").describe()
    assert "restart 0.0 s" in text
    assert text.endswith("(its staging copy took as long as the small write): no gain at this "
                         "size.")  # fmt: skip
