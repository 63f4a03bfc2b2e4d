"""Notebook 06's exercise checks: they pass on the solutions, say "not done" on the stubs, and
name each usual mistake."""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import exercises as ex
from labkit import profiling, train
from labkit.exercises import profiling as exprof
from labkit.profiling import overlap, phase

# --------------------------------------------------------------------------- solutions, written
# the way the solution notebook marks them (these are its cells, less the ex.check line, plus
# the imports they take from earlier cells), so the same source yields the stub.

SOLUTIONS = {
    "06.annotate": """
from labkit import train
from labkit.profiling import phase


def annotated_step(model, optimizer, next_batch, dtype):
    \"\"\"One training step in precision `dtype`, each phase inside phase(name); returns the loss.\"\"\"
    # BEGIN SOLUTION
    with phase("data"):
        x, y = next_batch()
    with phase("forward"), train.autocast(x.device, dtype):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss
    # END SOLUTION
answer = annotated_step
""",
    "06.hidden_fraction": """
def hidden_fraction(compute, comm):
    \"\"\"Share of the communication time that overlaps compute (0.0 with no communication).\"\"\"
    # BEGIN SOLUTION
    def merge(intervals):
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    m_compute, m_comm = merge(compute), merge(comm)
    total = sum(end - start for start, end in m_comm)
    hidden = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in m_compute for s2, e2 in m_comm)
    return hidden / total if total else 0.0
    # END SOLUTION
answer = hidden_fraction
""",
    "06.bottleneck": """
import statistics

from labkit import profiling


def diagnose(trace):
    \"\"\"(the phase with the most time per step in `trace`, DataLoader settings to fix it).\"\"\"
    # BEGIN SOLUTION
    seconds = trace.phase_seconds(profiling.PHASES)
    worst = max(seconds, key=lambda name: statistics.median(seconds[name]))
    settings = {"num_workers": 1, "prefetch_factor": 4, "persistent_workers": True}
    return worst, settings if worst == "data" else {}
    # END SOLUTION
answer = diagnose
""",
}


def test_the_notebook_06_exercises_are_registered():
    assert [e.id for e in ex.catalogue("06")] == [
        "06.annotate", "06.bottleneck", "06.hidden_fraction"]  # fmt: skip
    assert all(e.reference is not None for e in ex.catalogue("06"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_check_passes_on_the_solution_and_on_the_reference(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_the_stub_is_not_done_and_gives_nothing_away(exercise_id, capsys):
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys,
                            secrets=('with phase("data")', "loss.backward()", "zero_grad",
                                     "train.autocast",
                                     "merged", "min(e1, e2)", "phase_seconds",
                                     "statistics.median", "num_workers"))  # fmt: skip


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_hints_go_from_the_idea_to_the_recipe(exercise_id):
    hints = ex.get(exercise_id).hints
    assert 3 <= len(hints) <= 4 and hints[-1].startswith("recipe:")


# --------------------------------------------------------------------------- 06.annotate


def backward_in_forward(model, optimizer, next_batch, dtype):
    with phase("data"):
        x, y = next_batch()
    with phase("forward"), train.autocast(x.device, dtype):
        _, loss = model(x, y)
        loss.backward()
    with phase("backward"):
        pass
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def misnamed(model, optimizer, next_batch, dtype):
    with phase("data"):
        x, y = next_batch()
    with phase("fwd"):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def one_range(model, optimizer, next_batch, dtype):
    with phase("step"):
        x, y = next_batch()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def no_zero_grad(model, optimizer, next_batch, dtype):
    with phase("data"):
        x, y = next_batch()
    with phase("forward"), train.autocast(x.device, dtype):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
    return loss


def nested(model, optimizer, next_batch, dtype):
    with phase("data"):
        x, y = next_batch()
        with phase("forward"), train.autocast(x.device, dtype):
            _, loss = model(x, y)
            with phase("backward"):
                loss.backward()
                with phase("optimizer"):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
    return loss


def no_step(model, optimizer, next_batch, dtype):
    with phase("data"):
        x, y = next_batch()
    with phase("forward"), train.autocast(x.device, dtype):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.zero_grad(set_to_none=True)
    return loss


def zero_grad_before_step(model, optimizer, next_batch, dtype):
    # set_to_none=False keeps zero tensors: optimizer.step() runs, but on zero gradients
    with phase("data"):
        x, y = next_batch()
    with phase("forward"), train.autocast(x.device, dtype):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.zero_grad(set_to_none=False)
        optimizer.step()
    return loss


def no_autocast(model, optimizer, next_batch, dtype):  # the phases right, dtype ignored
    with phase("data"):
        x, y = next_batch()
    with phase("forward"):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def always_bf16(model, optimizer, next_batch, dtype):
    with phase("data"):
        x, y = next_batch()
    with phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def backward_under_autocast(model, optimizer, next_batch, dtype):
    with phase("data"):
        x, y = next_batch()
    with train.autocast(x.device, dtype):
        with phase("forward"):
            _, loss = model(x, y)
        with phase("backward"):
            loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def three_arguments(model, optimizer, next_batch):  # the step before it took a dtype
    return exprof.reference_annotated_step(model, optimizer, next_batch)


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (no_autocast, r"given dtype='bfloat16', the linear layers computed in \['float32'\]: "
                      r"the forward pass .* must run under autocast"),
        (always_bf16, r"given dtype='float32', the linear layers still computed in "
                      r"\['bfloat16'\]: float32 means autocast off"),
        (backward_under_autocast, r"given dtype='bfloat16', loss\.backward\(\) ran while "
                                  r"autocast was on: autocast wraps the forward pass and the "
                                  r"loss only"),
        (three_arguments, r"TypeError: .*takes 3 positional arguments but 4 were given"),
        (backward_in_forward, r"step 1: the autograd operators \(…Backward0\) belongs in "
                              r"'backward', but it ran inside 'forward'"),
        (misnamed, r"step 1: no range called 'forward' \(ranges found: \['fwd'\]\)"),
        (one_range, r"step 1: no range called 'data' \(ranges found: \['step'\]\)"),
        (no_zero_grad, r"after the step the gradients are still there: zero them after "
                       r"optimizer\.step\(\)"),
        (nested, r"step 1: 'data' is still open when 'forward' starts: the phases should follow "
                 r"each other, not nest"),
        (no_step, r"step 1: optimizer\.step\(\) belongs in 'optimizer', but it never ran"),
        (zero_grad_before_step, r"the weights never changed: .*optimizer\.step\(\) needs the "
                                r"gradients backward left"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_annotate_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("06.annotate", wrong)


# --------------------------------------------------------------------------- 06.hidden_fraction


def _overlap(a, b):
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def pairwise_unmerged(compute, comm):
    total = sum(e - s for s, e in comm)
    return _overlap(compute, comm) / total if total else 0.0


def hidden_time(compute, comm):  # the hidden microseconds, not divided by the total
    return overlap.hidden_fraction(compute, comm) * sum(e - s for s, e in comm)


def none_without_comm(compute, comm):
    return overlap.hidden_fraction(compute, comm) if comm else None


def exposed(compute, comm):
    return 1 - overlap.hidden_fraction(compute, comm)


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (pairwise_unmerged, r"two buckets all-reduced at once .*gave 0\.3333, expected 0\.3750: "
                            r"that is what summing the overlap of every .* pair gives, which "
                            r"counts time twice .* Merge each list"),
        (hidden_time, r"gave 30\.0000, expected 1\.0000: a fraction of the communication time "
                      r"cannot exceed 1"),
        (none_without_comm, r"hidden_fraction returned None for no communication at all; return "
                            r"a float between 0 and 1"),
        (lambda c, m: f"{overlap.hidden_fraction(c, m):.0%}", r"returned '100%' .*return a float"),
        (exposed, r"gave 0\.0000, expected 1\.0000: that is the exposed share"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_hidden_fraction_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("06.hidden_fraction", wrong)


def test_hidden_fraction_accepts_a_sweep_and_a_one_element_tensor():
    def sweep(compute, comm):  # walk the sorted endpoints, counting open intervals of each kind
        events = sorted([(s, 0, 1) for s, _ in compute] + [(e, 0, -1) for _, e in compute]
                        + [(s, 1, 1) for s, _ in comm] + [(e, 1, -1) for _, e in comm])  # fmt: skip
        open_, hidden, total, last = [0, 0], 0.0, 0.0, None
        for t, kind, step in events:
            if last is not None and open_[1]:
                total += t - last
                hidden += (t - last) if open_[0] else 0.0
            open_[kind] += step
            last = t
        return torch.tensor(hidden / total if total else 0.0)

    assert "matches labkit's on" in ex.verify("06.hidden_fraction", sweep)


def test_hidden_fraction_cases_catch_double_counting():
    # summing pairwise overlaps is wrong on some case (so the check can catch it), and every
    # expected answer is a fraction
    wrong = [pairwise_unmerged(c, m) for _, c, m in exprof._hidden_cases()]
    right = exprof._hidden_expected()
    assert any(abs(w - r) > 1e-3 for w, r in zip(wrong, right, strict=True))
    assert all(0.0 <= r <= 1.0 for r in right)


# --------------------------------------------------------------------------- 06.bottleneck
# Each call records two traces and may measure two loaders (about a second or two on a CPU):
# four mistakes, one call each.


def _worst(trace):
    seconds = trace.phase_seconds(profiling.PHASES)
    return max(seconds, key=lambda name: statistics.median(seconds[name]))


def always_data(trace):
    return "data", {"num_workers": 1}


def phase_only(trace):
    return _worst(trace)


def no_workers(trace):
    return _worst(trace), {"num_workers": 0, "prefetch_factor": None}


def not_dataloader_kwargs(trace):
    return _worst(trace), {"num_workers": 1, "bogus": 1}


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (always_data, r"on the trace not slowed by loading, diagnose named 'data', but its "
                      r"median phase times per step are .*read from the trace, not fixed in "
                      r"advance"),
        (phase_only, r"diagnose returned 'data'; return a pair \(phase name, dict of DataLoader "
                     r"settings\)"),
        (no_workers, r"keep num_workers=0: the training process still tokenises every batch"),
        (not_dataloader_kwargs, r"DataLoader\(dataset, batch_size=…, \*\*\{'num_workers': 1, "
                                r"'bogus': 1\}\) raised TypeError: .*'bogus'"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_bottleneck_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("06.bottleneck", wrong)


def test_bottleneck_loads_more_until_the_planted_slow_loader_shows(monkeypatch):
    # A trace where backward stays slowest, as on a machine busy with other work: the check
    # records again with more tokeniser passes, then says the machine is to blame, not the code.
    class BackwardBound:
        def phase_seconds(self, phases):
            return {"data": [0.010], "forward": [0.005], "backward": [0.012], "optimizer": [0.004]}

    passes = []
    monkeypatch.setattr(exprof, "_loader_trace",
                        lambda ds, tmp, name: passes.append(ds.passes) or BackwardBound())  # fmt: skip
    with pytest.raises(ex.ExerciseFailed, match=r"in 5 recorded traces the planted slow "
                                                r"loader never was the slowest phase: this "
                                                r"machine is busy"):  # fmt: skip
        ex.verify("06.bottleneck", exprof.reference_diagnose)
    assert len(passes) == exprof.BOTTLENECK_TRIES == 5
    assert all(b >= a * 1.25 * 1.2 for a, b in itertools.pairwise(passes))
