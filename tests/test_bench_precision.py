"""benchmarks/bench_precision.py: the same work per precision, the record, and refusals.

No speed is asserted: these check that every precision starts from the same weights and sees
the same batches through ``train_step``, that the record holds what it claims, and that a
precision the device cannot run is left out with its reason, or refused when named.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the checkout, not of labkit
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402
from benchmarks import bench_precision as bp  # noqa: E402
from labkit import config, train  # noqa: E402
from labkit.model import GPT  # noqa: E402

CPU = torch.device("cpu")
FP16_ON_CPU = bp.autocast_problem(CPU, "float16")


def test_the_record_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert bp.main(["--size", "smoke", "--rounds", "2", "--warmup", "0", "--device", "cpu",
                    "--out", str(out)]) == 0  # fmt: skip
    record = json.loads(out.read_text())
    _common.check_record(record)
    measured = record["params"]["precisions"]
    assert measured[0] == "float32" and "bfloat16" in measured
    assert set(measured) | set(record["skipped"]) == set(config.DTYPES)
    assert set(record["samples_s"]) == set(measured)
    assert all(len(s) == 2 for s in record["samples_s"].values())
    tokens = record["params"]["tokens_per_step"]
    assert tokens == 8 * 64  # smoke: micro_batch 8 × seq_len 64
    for dtype, r in record["results"].items():
        secs = record["samples_s"][dtype]
        assert r["tokens_per_s"] == pytest.approx(tokens / statistics.median(secs))
        assert r["speed_vs_float32"] == pytest.approx(
            statistics.median(record["samples_s"]["float32"]) / statistics.median(secs))
        assert r["steps_incl_warmup"] == 2 and r["first_loss"] > 0
    assert record["results"]["float32"]["speed_vs_float32"] == 1.0
    assert record["ratio"] == pytest.approx(1 / record["results"]["bfloat16"]["speed_vs_float32"])
    # a CPU: no GPU target, and the label says whose ratio it is
    assert record["target"] is None and record["within_target"] is None
    assert "not a GPU speedup" in record["label"]
    assert record["cpu_support"]["notes"] and "cpu_flags" in record["machine"]
    printed = capsys.readouterr().out
    assert "not a GPU speedup" in printed and "CPU support" in printed


def test_every_precision_starts_from_the_same_weights_and_sees_the_same_batches():
    cfg = config.preset("smoke")
    replicas = bp.make_replicas(cfg, ["float32", "bfloat16"], CPU, seed=0)
    a, b = (replicas[d].model for d in ("float32", "bfloat16"))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert b.lm_head.weight is b.wte.weight  # the copy keeps the weight tying
    batches = bp.make_batches(cfg, CPU, seed=0, n_steps=2)
    steps = {d: bp.step_fn(r, batches, CPU, cfg.train.grad_clip) for d, r in replicas.items()}
    for _ in range(3):
        assert steps["float32"]() > 0 and steps["bfloat16"]() > 0

    # the reference: a model from the same seed, train_step on the same batches in order
    torch.manual_seed(0)
    ref = GPT(cfg.model)
    opt = train.make_optimizer(ref, cfg.train)
    expected = [train.train_step(ref, opt, batches[i % 2], device=CPU,
                                 grad_clip=cfg.train.grad_clip).loss for i in range(3)]  # fmt: skip
    assert replicas["float32"].losses == expected  # identical work, so identical in fp32
    # bf16 starts from the same weights on the same batch: the same loss up to rounding
    assert replicas["bfloat16"].losses[0] == pytest.approx(expected[0], abs=0.05)


@pytest.mark.skipif(FP16_ON_CPU is not None, reason=f"no fp16 training on this CPU: {FP16_ON_CPU}")
def test_a_step_the_scaler_skips_is_counted():
    cfg = config.preset("smoke")
    replica = bp.make_replicas(cfg, ["float16"], CPU, seed=0)["float16"]
    # a scale so large that the fp16 gradients overflow: the scaler must skip and back off
    replica.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    before = [p.detach().clone() for p in replica.model.parameters()]
    bp.step_fn(replica, bp.make_batches(cfg, CPU, 0, 1), CPU, cfg.train.grad_clip)()
    assert replica.skipped_steps == 1 and replica.scaler.get_scale() == 2.0**59
    assert all(torch.equal(p, q) for p, q in zip(before, replica.model.parameters(),
                                                 strict=True))  # fmt: skip


def test_autocast_problem_tries_the_dtype_rather_than_assuming_it(monkeypatch):
    assert bp.autocast_problem(CPU, "float32") is None
    assert bp.autocast_problem(CPU, "bfloat16") is None  # CPU autocast has bf16

    def refuse(device_type, dtype):
        raise ValueError(f"no {dtype} autocast on {device_type}")

    monkeypatch.setattr(bp.precision, "checked_autocast", refuse)
    assert bp.autocast_problem(CPU, "bfloat16") == "no bfloat16 autocast on cpu"


def test_fp16_needs_an_enabled_loss_scaler(monkeypatch):
    monkeypatch.setattr(bp.precision, "checked_autocast", lambda *_: contextlib.nullcontext())
    monkeypatch.setattr(bp.train, "make_scaler",
                        lambda device, dtype: torch.amp.GradScaler("cpu", enabled=False))
    assert "GradScaler('cpu') is not enabled" in bp.autocast_problem(CPU, "float16")
    assert bp.autocast_problem(CPU, "bfloat16") is None  # bf16 needs no scaler


@pytest.mark.parametrize(("requested", "match"), [
    ("fp8", "float32, tf32, bfloat16, float16"),
    ("fp32,tf32", "not an autocast dtype"),
    ("bf16", "lacks float32"),
    ("fp32,fp32", "named twice"),
])  # fmt: skip
def test_bad_precisions_are_refused_with_what_is_allowed(requested, match):
    with pytest.raises(ValueError, match=match):
        bp.choose_precisions(requested, CPU)
    with pytest.raises(SystemExit, match=match):
        bp.main(["--precisions", requested, "--device", "cpu", "--rounds", "1"])


def test_an_unsupported_precision_is_left_out_with_its_reason_or_refused_when_named(monkeypatch):
    monkeypatch.setattr(bp, "autocast_problem",
                        lambda device, dtype: "no fp16 here" if dtype == "float16" else None)
    chosen, skipped = bp.choose_precisions("auto", CPU)
    assert chosen == ["float32", "bfloat16"] and skipped == {"float16": "no fp16 here"}
    with pytest.raises(ValueError, match="'float16' cannot run here: no fp16 here"):
        bp.choose_precisions("fp32,fp16", CPU)
    assert bp.choose_precisions("bf16, fp32", CPU) == (["float32", "bfloat16"], {})
