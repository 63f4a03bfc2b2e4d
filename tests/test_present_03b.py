"""What notebook 03b's cells print, now that labkit tells it: the mesh's groups and refusals,
the predicted bytes and memory, the mesh job's groups, bytes, parity and memory held against
them, the step times, exercise 2's run, and the data × pipeline section.

The model is the notebook's smoke-size GPT, so the predicted lines are the ones the notebook
printed in its smoke run on the course's CPU machine; the jobs' rank results are built here from
the predictions (a job that measured exactly what was predicted), then spoilt to show each
sentence that says something DIFFERS."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import pytest

from labkit.config import ModelConfig
from labkit.jobs.launch import JobResult
from labkit.parallel import mesh
from labkit.workers import dp_pp_report, mesh_report, mesh_train, pp_compose

matplotlib.use("Agg")

MIB = 2**20
SMOKE = {"seq_len": 32, "n_layer": 4, "n_head": 4, "d_model": 64}
LAYOUTS = {"fsdp_tp": {"dp": 2, "tp": 2}, "hsdp": {"replicate": 2, "shard": 2}}


# --- section 1: the mesh before any process -----------------------------------------------------


def test_a_mesh_describes_each_ranks_groups():
    assert mesh.as_spec({"dp": 2, "tp": 2}).describe() == "\n".join([
        "mesh dp=2 × tp=2: each rank's groups, predicted by group_ranks (row-major layout)",
        "  rank    dp group    tp group",
        "     0      [0, 2]      [0, 1]",
        "     1      [1, 3]      [0, 1]",
        "     2      [0, 2]      [2, 3]",
        "     3      [1, 3]      [2, 3]",
        "all groups along 'dp': [[0, 2], [1, 3]], along 'tp': [[0, 1], [2, 3]]",
    ])  # fmt: skip
    one_dim = mesh.as_spec({"x": 2}).describe().splitlines()
    assert one_dim[1:] == ["  rank     x group", "     0      [0, 1]", "     1      [0, 1]",
                           "all groups along 'x': [[0, 1]]"]  # fmt: skip


def test_the_refusals_are_validate_meshs_messages_and_an_accepted_mesh_says_so():
    cfg = ModelConfig(**SMOKE)
    text = mesh.describe_refusals([({"dp": 2, "tp": 3}, cfg), ({"dp": 2, "tp": 2}, cfg)], 4)
    assert text == "\n".join([
        "Meshes refused before anything starts:",
        "  {'dp': 2, 'tp': 3}: mesh dp=2 × tp=3 has 2 × 3 = 6 cells but the job has world_size=4 "
        "ranks: the sizes must multiply to the world size, one rank per cell; change a size or "
        "launch 6 ranks",
        "  {'dp': 2, 'tp': 2}: accepted (a mesh of 4 cells)",
    ])  # fmt: skip


def test_link_times_are_bytes_over_each_links_bandwidth():
    comm_ = {"tp": {"sent_per_rank": 2e9, "calls": {"all_reduce": 128}}, "dp": {"sent_per_rank": 1e9}}
    links = [SimpleNamespace(name="fast", bytes_per_s=1e11, source="a datasheet"),
             SimpleNamespace(name="slow", bytes_per_s=1e10, source="a paper")]  # fmt: skip
    assert mesh.describe_link_times(comm_, links) == "\n".join([
        "bytes sent per GPU per micro-batch (predicted), and the time on each link (modelled):",
        "  TP all-reduces                   2.00 GB: 20 ms on fast, 200 ms on slow",
        "  FSDP gathers + reduce-scatter    1.00 GB: 10 ms on fast, 100 ms on slow",
        "TP's 128 all-reduces sit on the critical path, FSDP's gathers overlap computation: "
        "section 1's reason for TP on the innermost dimension.",
        "Bandwidths (per GPU, each way): fast: a datasheet; slow: a paper",
    ])  # fmt: skip


# --- the prediction ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pred() -> mesh_report.MeshPrediction:
    return mesh_report.predict(SMOKE, LAYOUTS, 8)


def test_the_prediction_prints_the_notebooks_smoke_figures(pred):
    assert pred.rows == {"fsdp_tp": 4, "hsdp": 2}
    assert pred.single_bytes == 16 * 218_496
    assert pred.describe() == "\n".join([
        "GPT {'seq_len': 32, 'n_layer': 4, 'n_head': 4, 'd_model': 64}: 218,496 parameters; one "
        "process holds 3.33 MiB of parameters + gradients + AdamW state (fp32)",
        "",
        "fsdp_tp (global batch 8, 4 rows per data shard), predicted per step:",
        "         tp (n=2): 16 all_reduce of 0.50 MiB in all; sent per rank 0.50 MiB",
        "         dp (n=2): 9 all_gather of 0.84 MiB in all, 5 reduce_scatter of 0.46 MiB in all; "
        "sent per rank 0.65 MiB",
        "  memory per rank predicted: 0.91 MiB (27% of one process's)",
        "",
        "hsdp (global batch 8, 2 rows per data shard), predicted per step:",
        "      shard (n=2): 9 all_gather of 1.60 MiB in all, 5 reduce_scatter of 0.83 MiB in all; "
        "sent per rank 1.21 MiB",
        "  replicate (n=2): 5 all_reduce of 0.42 MiB in all; sent per rank 0.42 MiB",
        "  memory per rank predicted: 1.67 MiB (50% of one process's)",
    ])  # fmt: skip


def test_the_learners_guess_is_held_against_the_formula():
    guessed = mesh_report.predict(SMOKE, LAYOUTS, 8, guess={"fsdp_tp": 0.25, "hsdp": 0.9})
    assert guessed.describe().splitlines()[-2:] == [
        "your prediction for fsdp_tp: 25% of one process's state; the formula says 27% (agrees)",
        "your prediction for hsdp: 90% of one process's state; the formula says 50%",
    ]
    skipped = mesh_report.predict(SMOKE, LAYOUTS, 8, guess={"fsdp_tp": None, "hsdp": None})
    assert "your prediction" not in skipped.describe()


# --- the mesh job: a fake one that measured what was predicted ---------------------------------


def _mesh_rank(r: int, pred: mesh_report.MeshPrediction, step_s: dict[str, list[float]]) -> dict:
    out = {"rank": r, "groups": {p: {d: mesh.group_ranks(s, d, r) for d in s} for p, s in LAYOUTS.items()}}
    for part, shape in LAYOUTS.items():
        out[part] = {
            "mesh": dict(shape), "losses": [5.4741, 5.283, 4.9865], "step_s": list(step_s[part]),
            "bytes": copy.deepcopy(pred.comm[part]), "bytes_unknown_ops": [],
            "memory": {k: int(v) for k, v in pred.memory[part].items()},
        }  # fmt: skip
    return out


def _mesh_job(pred, step_s=None, log_dir: Path = Path("/tmp/none"), config=None) -> JobResult:
    step_s = step_s or {"fsdp_tp": [1.0, 0.2, 0.2], "hsdp": [1.0, 0.1, 0.1]}
    config = config or mesh_train.MeshTrainConfig(model=SMOKE, batch_size=8, steps=3, seed=0)
    return JobResult(module="labkit.workers.mesh_train", job_id="j", nproc=4, backend="gloo",
                     device="cpu", ranks=[_mesh_rank(r, pred, step_s) for r in range(4)],
                     wall_s=9.0, log_dir=log_dir, status="ok", returncode=0,
                     config=config.to_dict())  # fmt: skip


def test_groups_read_back_agree_or_name_the_prediction(pred):
    job = _mesh_job(pred)
    groups = mesh_report.check_groups(job, LAYOUTS)
    lines = groups.describe().splitlines()
    assert lines[0] == "groups read from torch's DeviceMesh (measured) against group_ranks (predicted):"
    assert lines[1:3] == ["  rank 0 fsdp_tp        dp: [0, 2] (as predicted)",
                          "  rank 0 fsdp_tp        tp: [0, 1] (as predicted)"]  # fmt: skip
    assert lines[5] == "  rank 3 fsdp_tp        dp: [1, 3] (as predicted)"
    assert len(lines) == 10 and lines[-1] == "every rank's groups agree with the prediction"
    job.ranks[1]["groups"]["hsdp"]["shard"] = [1, 3]  # rank 1 is not shown, but it is checked
    bad = mesh_report.check_groups(job, LAYOUTS)
    assert not bad.agree and bad.describe().splitlines()[-1] == "SOME GROUPS DIFFER"
    job.ranks[3]["groups"]["fsdp_tp"]["tp"] = [3, 2]
    assert "  rank 3 fsdp_tp        tp: [3, 2] (PREDICTED [2, 3])" in mesh_report.check_groups(
        job, LAYOUTS).describe().splitlines()


def test_bytes_counted_against_predicted(pred):
    job = _mesh_job(pred)
    counted = mesh_report.check_bytes(job, pred)
    assert counted.describe() == "\n".join([
        "bytes per step on each dimension, rank 0 (counted in the first step, against predicted):",
        "               dim   calls  counted MiB  predicted MiB  sent/rank MiB",
        " fsdp_tp        tp      16        0.500          0.500          0.500",
        " fsdp_tp        dp      14        1.294          1.294          0.647",
        "    hsdp     shard      14        2.430          2.430          1.215",
        "    hsdp replicate       5        0.417          0.417          0.417",
        "counted == predicted, call for call and byte for byte",
    ])  # fmt: skip
    job.ranks[0]["hsdp"]["bytes"]["replicate"]["calls"]["all_reduce"] = 6
    job.ranks[0]["hsdp"]["bytes_unknown_ops"] = ["c10d.broadcast_"]
    lines = mesh_report.check_bytes(job, pred).describe().splitlines()
    assert lines[-3:] == ["    hsdp replicate       6        0.417          0.417          0.417",
                          "  collectives the spy could not file: ['c10d.broadcast_']",
                          "counted and predicted DIFFER: see the rows above"]  # fmt: skip


def test_memory_measured_against_predicted_and_drawn(pred):
    job = _mesh_job(pred)
    memory = mesh_report.check_memory(job, pred)
    assert memory.describe() == "\n".join([
        "                           parameters        gradients  optimizer_state       total   (MiB per rank)",
        "         one process            0.833            0.833            1.667       3.334",
        "   fsdp_tp  measured            0.228            0.228            0.455       0.910",
        "   fsdp_tp predicted            0.228            0.228            0.455       0.910",
        "      hsdp  measured            0.417            0.417            0.833       1.667",
        "      hsdp predicted            0.417            0.417            0.833       1.667",
        "every rank holds the same bytes, equal to the prediction to the byte",
    ])  # fmt: skip
    job.ranks[2]["hsdp"]["memory"]["total"] += 4
    job.ranks[2]["hsdp"]["memory"]["gradients"] += 4
    spoilt = mesh_report.check_memory(job, pred)
    totals = spoilt.totals["hsdp"]
    assert totals[2] == totals[0] + 4
    assert spoilt.describe().splitlines()[-1] == (
        f"ranks differ: {spoilt.totals}; and they DIFFER from the prediction")
    ax = mesh_report.plot_memory(memory)
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "one process", "FSDP2 × TP\n(dp 2 × tp 2)", "HSDP\n(replicate 2 × shard 2)"]
    assert ax.get_title() == "fp32 parameters + gradients + AdamW state, GPT 4 layers × d 64"
    heights = [round(p.get_height(), 3) for p in ax.patches]
    assert heights[:3] == [3.334, 0.910, 1.667] and math.isnan(heights[3]) and heights[4:] == [0.910, 1.667]
    matplotlib.pyplot.close("all")


def test_the_reconcile_lists_each_check_and_its_verdict(pred):
    job = _mesh_job(pred)
    groups, counted = mesh_report.check_groups(job, LAYOUTS), mesh_report.check_bytes(job, pred)
    memory = mesh_report.check_memory(job, pred)
    good = mesh_report.Parity(reference_losses=[1.0], losses={"hsdp": [1.0]}, steps=1,
                             errors={"hsdp": {"loss": 0.0, "grad": 0.0, "param": 0.0}})  # fmt: skip
    assert mesh_report.reconcile(groups, counted, memory, good).describe() == "\n".join([
        "agrees: groups read from the DeviceMesh == group_ranks",
        "agrees: bytes counted on every dimension == predict_comm",
        "agrees: model state measured on every rank == predict_memory",
        "agrees: losses, gradients, parameters == one process (fp32 rounding)",
        "the prediction holds for both compositions",
    ])  # fmt: skip
    bad = mesh_report.Parity(reference_losses=[1.0], losses={"hsdp": [1.1]}, steps=1,
                            errors={"hsdp": {"loss": 0.1, "grad": 0.0, "param": 0.0}})  # fmt: skip
    lines = mesh_report.reconcile(groups, counted, memory, bad).describe().splitlines()
    assert lines[3:] == [
        "DIFFERS: losses, gradients, parameters == one process (fp32 rounding)",
        "the prediction FAILS where a line says DIFFERS: that is the part of the model to revisit"]


def test_step_times_choose_their_sentence(pred):
    # the first step (1.0) warms up and is left out
    clear = {"fsdp_tp": [1.0, 0.200, 0.201, 0.202, 0.203, 0.204, 0.205],
             "hsdp": [1.0, 0.100, 0.101, 0.102, 0.103, 0.104, 0.105]}  # fmt: skip
    steps = mesh_report.compare_steps(_mesh_job(pred, clear))
    assert steps.comparison.outcome == "faster" and steps.steps == 6
    lines = steps.describe().splitlines()
    assert lines[2].startswith("verdict: hsdp step, slowest rank is faster than fsdp_tp step")
    assert lines[3:] == [
        "(measured: 6 steps after the first, the slowest rank's time in each)",
        "a likely cause, not measured apart here: FSDP x TP adds TP's activation all-reduces "
        "(counted above), each one waited for, and runs every matmul half as wide; on 4 ranks "
        "sharing 2 cores, contention can weigh as much",
        "on this tier: 4 CPU ranks on shared cores over gloo; these times are not a GPU's"]
    short = mesh_report.compare_steps(_mesh_job(pred)).describe().splitlines()  # 2 steps: noisy
    assert short[2].startswith("verdict: too noisy to tell") and "likely cause" not in "".join(short)
    assert short[3] == "(measured: 2 steps after the first, the slowest rank's time in each)"


def test_parity_holds_for_a_job_that_saved_the_reference_and_fails_for_one_that_did_not(tmp_path):
    import torch

    tiny = {"seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16}
    config = mesh_train.MeshTrainConfig(model=tiny, batch_size=4, steps=2, seed=0)
    losses, grads, params = mesh_report.reference_run(config)
    assert len(losses) == 2 and set(grads) == set(params)
    saved = {"params": {n: p.detach().clone() for n, p in params.items()}, "first_grads": grads}
    for part in ("fsdp_tp", "hsdp"):
        torch.save(saved, tmp_path / f"mesh_{part}_params.pt")
    pred = mesh_report.predict(tiny, LAYOUTS, 4)
    job = _mesh_job(pred, log_dir=tmp_path, config=config)
    for r in job.ranks:
        for part in LAYOUTS:
            r[part]["losses"] = list(losses)
    parity = mesh_report.check_parity(job)
    assert parity.ok and parity.errors["hsdp"] == {"loss": 0.0, "grad": 0.0, "param": 0.0}
    rounded = [round(v, 4) for v in losses]
    assert parity.describe() == "\n".join([
        f"single process: losses {rounded}",
        f"       fsdp_tp: losses {rounded}; max |difference| from one process (measured): loss "
        "0.0e+00, first-step gradient 0.0e+00, parameters after 2 AdamW steps 0.0e+00",
        f"          hsdp: losses {rounded}; max |difference| from one process (measured): loss "
        "0.0e+00, first-step gradient 0.0e+00, parameters after 2 AdamW steps 0.0e+00",
        "both compositions train the same model as one process (differences at fp32 rounding: "
        "the collectives add in another order)",
    ])  # fmt: skip
    name = next(iter(saved["params"]))
    saved["params"][name] = saved["params"][name] + 0.01
    torch.save(saved, tmp_path / "mesh_hsdp_params.pt")
    spoilt = mesh_report.check_parity(job)
    assert abs(spoilt.errors["hsdp"]["param"] - 0.01) < 1e-6
    assert spoilt.describe().splitlines()[-1] == "PARITY FAILED: a composition trains another model"


# --- exercise 2: the measurements, the choice, its run -----------------------------------------


def test_the_measurements_choose_mesh_reads_and_their_description(pred):
    job = _mesh_job(pred)
    job.ranks[3]["hsdp"]["memory"]["parameters"] += 8  # the fullest rank's memory is taken
    got = mesh_report.measured(job)
    assert got["hsdp"]["memory"]["parameters"] == int(pred.memory["hsdp"]["parameters"]) + 8
    assert got["fsdp_tp"]["mesh"] == {"dp": 2, "tp": 2}
    assert got["fsdp_tp"]["sent"] == {d: v["sent_per_rank"] for d, v in pred.comm["fsdp_tp"].items()}
    budget = 0.6 * pred.single_bytes
    assert mesh_report.describe_measured(mesh_report.measured(_mesh_job(pred)), budget) == "\n".join([
        "budget per GPU: 2.00 MiB of model state",
        " fsdp_tp on {'dp': 2, 'tp': 2}: model state 0.91 MiB per rank; sent per rank per step tp "
        "0.50 MiB, dp 0.65 MiB (measured)",
        "    hsdp on {'replicate': 2, 'shard': 2}: model state 1.67 MiB per rank; sent per rank per "
        "step shard 1.21 MiB, replicate 0.42 MiB (measured)",
    ])  # fmt: skip


def test_the_choice_its_groups_and_its_run(pred):
    measured = mesh_report.measured(_mesh_job(pred))
    choice = {"replicate": 2, "shard": 2}
    assert mesh_report.composition_of(choice, measured) == "hsdp"
    assert mesh_report.composition_of({"tp": 2, "dp": 2}, measured) == "fsdp_tp"
    assert mesh_report.composition_of(None, measured) is None
    assert mesh_report.describe_choice(None) == "nothing to run: neither composition fits the budget"
    assert mesh_report.describe_choice(choice) == (
        "predicted groups: inner 'shard' [[0, 1], [2, 3]] (one node each), outer 'replicate' "
        "[[0, 2], [1, 3]] (across the nodes)")
    run = mesh_report.check_choice(_mesh_job(pred), choice, measured, 0.6 * pred.single_bytes)
    assert run.describe() == "\n".join([
        "measured: model state 1.67 MiB on the fullest rank against a budget of 2.00 MiB: it fits",
        "counted: 0.42 MiB per rank per step cross the nodes on 'replicate', 1.21 MiB stay inside "
        "on 'shard'",
        "the other, fsdp_tp: model state 0.91 MiB (fits); per rank per step tp 0.50 MiB, dp 0.65 "
        "MiB (measured above)",
    ])  # fmt: skip
    tight = mesh_report.check_choice(_mesh_job(pred), choice, measured, 1.0 * MIB)
    lines = tight.describe().splitlines()
    assert lines[0].endswith("against a budget of 1.00 MiB: it does NOT fit")
    assert lines[2].startswith("the other, fsdp_tp: model state 0.91 MiB (fits)")
    assert "(does not fit)" in mesh_report.check_choice(
        _mesh_job(pred), choice, measured, 0.5 * MIB).describe()


# --- section 3: data × pipeline ----------------------------------------------------------------


def test_the_dp_pp_prediction_prints_the_notebooks_smoke_figures():
    got = dp_pp_report.predict_dp_pp(ModelConfig(**SMOKE), 4, 2, 2, 8, 4)
    assert got.stage_params == [118_400, 116_480] and got.zero3_over_zero1 == 6
    assert got.describe() == "\n".join([
        "mesh ('pp', 'dp') = (2, 2); each replica runs 4 of the 8 sequences as m = 4 "
        "micro-batches; stages (blocks): [(0, 2), (2, 4)]",
        "",
        "predicted dp traffic per stage per optimizer step (fp32 gradients, ring formulas, d = 2; "
        "zero1: a reduce-scatter and an all-gather for each of its 2 flat buffers):",
        "stage    params | sync            calls  sent per rank",
        "    0   118,400 | all_reduce          1       0.474 MB",
        "    0   118,400 | per_microbatch      4       1.894 MB",
        "    0   118,400 | zero1               4       0.474 MB",
        "    0   118,400 | zero3              12       2.842 MB",
        "    1   116,480 | all_reduce          1       0.466 MB",
        "    1   116,480 | per_microbatch      4       1.864 MB",
        "    1   116,480 | zero1               4       0.466 MB",
        "    1   116,480 | zero3              12       2.796 MB",
        "",
        "predicted AdamW state per rank: 0.947 MB replicated (stage 0), 0.474 MB with ZeRO-1 "
        "over dp = 2",
        "ZeRO-3 would send 6x ZeRO-1's bytes per step at m = 4 (3m/2) if it gathered per "
        "micro-batch: predicted, not run here (deferred as torch's PipelineStage does, it sends "
        "ZeRO-1's bytes and keeps the gathered parameters)",
    ])  # fmt: skip
    with pytest.raises(ValueError):
        dp_pp_report.predict_dp_pp(ModelConfig(**SMOKE), 4, 2, 3, 8, 4)  # 2 x 3 is not 4 ranks


def _dpp_rank(r: int) -> dict:
    stage, P = r // 2, (118_400, 116_480)[r // 2]
    run = {
        "all_reduce": {"counted": {"last_step": {"all_reduce": {"calls": 1, "message_bytes": 4 * P}}},
                       "predicted": {"calls": 1, "message_bytes": 4 * P},
                       "optimizer_state_bytes": 8 * P, "stage_params": P, "loss_error": 4.8e-7,
                       "grad_error": 6e-8, "weight_error": 5.9e-6, "last_backward_end_s": 0.0254,
                       "sync_start_s": 0.0271, "sync_end_s": 0.0367},
        "zero1": {"counted": {"last_step": {"reduce_scatter": {"calls": 2, "message_bytes": 4 * P},
                                            "all_gather": {"calls": 2, "message_bytes": 4 * P}}},
                  "predicted": {"calls": 4, "message_bytes": 4 * P},
                  "optimizer_state_bytes": 4 * P, "stage_params": P, "loss_error": 4.8e-7,
                  "grad_error": float("nan"), "weight_error": 5.9e-6},
    }  # fmt: skip
    return {"rank": r, "stage": stage, "dp_rank": r % 2, "pp_group": [r % 2, r % 2 + 2],
            "dp_group": [2 * stage, 2 * stage + 1], "runs": run,
            "events": [{"rank": 0, "kind": "F", "mb": 0, "start_s": 0.001, "end_s": 0.002}]}  # fmt: skip


def _dpp_job() -> JobResult:
    config = pp_compose.PPComposeConfig(part="dp_pp", model=SMOKE, batch_size=8, microbatches=4,
                                        pp=2, dp=2)  # fmt: skip
    return JobResult(module="labkit.workers.pp_compose", job_id="j", nproc=4, backend="gloo",
                     device="cpu", ranks=[_dpp_rank(r) for r in range(4)], wall_s=5.0,
                     log_dir=Path("/tmp/none"), status="ok", returncode=0,
                     config=config.to_dict())  # fmt: skip


def test_the_dp_pp_job_held_against_its_prediction():
    check = dp_pp_report.check_dp_pp(_dpp_job())
    lines = check.describe().splitlines()
    assert lines[:3] == [
        "rank stage  pp group  dp group | sync       calls counted/pred  bytes counted/pred (MB)  "
        "opt. state (MB) meas/pred",
        "   0     0    [0, 2]    [0, 1] | all_reduce         1 / 1           0.4736 / 0.4736     "
        "     0.9472 / 0.9472",
        "   0     0    [0, 2]    [0, 1] | zero1              4 / 4           0.4736 / 0.4736     "
        "     0.4736 / 0.4736",
    ]  # fmt: skip
    assert lines[9:] == [
        "(bytes: the message each collective carries, counted by our wrappers; ZeRO-1's flat "
        "buffers are padded to a multiple of dp)",
        "counted calls equal the predicted ones on every rank; ZeRO-1 optimizer state / "
        "replicated, measured: 0.5000..0.5000 (predicted 1/dp = 0.5000)",
        "",
        "parity with one process (same seed, whole batch, one AdamW step), max over ranks:",
        "  all_reduce |loss diff| 4.8e-07, |grad diff| 6.0e-08, |weight diff after the step| 5.9e-06",
        "  zero1      |loss diff| 4.8e-07, |grad diff| n/a (each rank keeps only its shard's mean), "
        "|weight diff after the step| 5.9e-06",
        "→ the counts are exact and parity holds to float32 rounding (|loss diff| < 1e-4, |grad "
        "diff| < 1e-5, |weight diff| < 1e-3)",
        "rank 0 (stage 0): last backward ended 25.4 ms, dp all-reduce 27.1 -> 36.7 ms (measured)",
        "rank 1 (stage 0): last backward ended 25.4 ms, dp all-reduce 27.1 -> 36.7 ms (measured)",
        "rank 2 (stage 1): last backward ended 25.4 ms, dp all-reduce 27.1 -> 36.7 ms (measured)",
        "rank 3 (stage 1): last backward ended 25.4 ms, dp all-reduce 27.1 -> 36.7 ms (measured)",
    ]  # fmt: skip
    job = _dpp_job()
    job.ranks[2]["runs"]["zero1"]["counted"]["last_step"]["all_gather"]["calls"] = 3
    job.ranks[1]["runs"]["all_reduce"]["weight_error"] = 0.5
    spoilt = dp_pp_report.check_dp_pp(job).describe().splitlines()
    assert spoilt[10].startswith("counted calls DIFFER FROM the predicted ones on every rank")
    assert spoilt[15] == "→ the counts DIFFER from the prediction and parity FAILS: see the rows above"


def test_the_dp_pp_timeline_draws_each_ranks_all_reduce():
    check = dp_pp_report.check_dp_pp(_dpp_job())
    ax = dp_pp_report.plot_dp_pp(check)
    assert ax.get_title() == "1F1B on two pipelines, then the dp all-reduce (measured)"
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 (stage 0, replica 0)", "rank 1 (stage 0, replica 1)",
        "rank 2 (stage 1, replica 0)", "rank 3 (stage 1, replica 1)"]
    red = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("#d62728")]
    assert len(red) == 4 and round(red[0].get_x(), 6) == 27.1 and round(red[0].get_width(), 6) == 9.6
    assert ax.get_xlabel() == "time since the step's start (ms); red: gradient all-reduce over dp"
    matplotlib.pyplot.close("all")
