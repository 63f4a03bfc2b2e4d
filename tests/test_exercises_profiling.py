"""Notebook 06's exercise checks: they pass on the solutions, say "not done" on the stubs, and
name each usual mistake."""

from __future__ import annotations

import datetime
import statistics
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as tdist
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import profiling, train
from labkit.course import exercises as ex
from labkit.course.exercises import profiling as exprof
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
from labkit.profiling import overlap


def diagnose(trace):
    \"\"\"(the longest phase of `trace`, and what took its time: "loading", "waiting for
    another rank" or "compute").\"\"\"
    # BEGIN SOLUTION
    seconds = trace.phase_seconds(profiling.PHASES)
    worst = max(seconds, key=lambda name: statistics.median(seconds[name]))
    window = overlap.union((s.start_us, s.end_us) for s in trace.spans(
        cat="user_annotation", name=worst, tid=trace.main_tid))
    compute, comm = profiling.compute_and_comm(trace)
    exposed = overlap.subtract(comm, compute)
    if overlap.length(overlap.intersect(exposed, window)) > 0.5 * overlap.length(window):
        return worst, "waiting for another rank"
    return worst, "loading" if worst == "data" else "compute"
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
                                     "compute_and_comm", "overlap.subtract", "0.5 *"))  # fmt: skip


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
# Each check reads six traces it builds (milliseconds, no job runs). Each likely mistake below
# fails on the first case built to catch it, with a message that names it.

WAIT = "waiting for another rank"


def _worst(trace):
    seconds = trace.phase_seconds(profiling.PHASES)
    return max(seconds, key=lambda name: statistics.median(seconds[name]))


def _window(trace, name):
    return [(s.start_us, s.end_us)
            for s in trace.spans(cat="user_annotation", name=name, tid=trace.main_tid)]  # fmt: skip


def _own(phase_name):
    return "loading" if phase_name == "data" else "compute"


def fixed_cause(trace):  # the old exercise: the argmax, and a cause that never changes
    return _worst(trace), "loading"


def cause_from_the_name(trace):
    return _worst(trace), _own(_worst(trace))


def any_collective(trace):  # a collective anywhere in the trace taken for a wait
    _, comm = profiling.compute_and_comm(trace)
    return _worst(trace), WAIT if comm else _own(_worst(trace))


def gloo_counted_as_training(trace):  # every thread's ranges and operators counted as busy
    worst, window = _worst(trace), _window(trace, _worst(trace))
    busy = [(s.start_us, s.end_us) for s in trace.all_spans
            if s.cat in ("cpu_op", "user_annotation") and s.name not in profiling.PHASES
            and not s.name.startswith("ProfilerStep")]  # fmt: skip
    _, comm = profiling.compute_and_comm(trace)
    waiting = overlap.length(overlap.intersect(overlap.subtract(comm, busy), window))
    return worst, WAIT if waiting > 0.5 * overlap.length(window) else _own(worst)


def whole_trace_share(trace):  # exposed share of the whole step, not of the phase
    times = profiling.rank_times(trace)
    return _worst(trace), WAIT if times.exposed_s > 0.5 * times.step_s else _own(_worst(trace))


def whole_trace_against_compute(trace):
    times = profiling.rank_times(trace)
    return _worst(trace), WAIT if times.exposed_s > times.compute_s else _own(_worst(trace))


def whole_trace_against_the_phase(trace):  # the whole trace's exposed time, the phase's length
    seconds = trace.phase_seconds(profiling.PHASES)
    worst = _worst(trace)
    exposed = profiling.rank_times(trace).exposed_s
    return worst, WAIT if exposed > 0.5 * statistics.median(seconds[worst]) else _own(worst)


def idle_is_waiting(trace):  # a training thread with no operator taken for a wait
    worst, window = _worst(trace), _window(trace, _worst(trace))
    compute, _ = profiling.compute_and_comm(trace)
    busy = overlap.length(overlap.intersect(compute, window))
    return worst, WAIT if busy < 0.5 * overlap.length(window) else _own(worst)


def most_operators(trace):  # the phase with the most operators, not the most time
    main = trace.main_tid
    phases = trace.spans(cat="user_annotation", tid=main)
    ops = trace.spans(cat="cpu_op", tid=main)
    count = {n: sum(1 for p in phases if p.name == n for o in ops
                    if p.start_us <= o.start_us < p.end_us) for n in profiling.PHASES}  # fmt: skip
    return max(count, key=count.__getitem__), exprof.reference_diagnose(trace)[1]


def phase_only(trace):
    return _worst(trace)


def short_cause(trace):
    phase_name, cause = exprof.reference_diagnose(trace)
    return phase_name, "waiting" if cause == WAIT else cause


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (fixed_cause, r"a DDP rank whose backward computes .*said \('backward', 'loading'\); "
                      r"expected \('backward', 'compute'\): 'loading' for a 'backward' phase in "
                      r"which the training thread computed 89% .*a cause fixed in advance"),
        (cause_from_the_name, r"peer is late to the all-reduce, diagnose said \('backward', "
                              r"'compute'\).*computed only 28% .*for 72%.*'compute' is what the "
                              r"phase's name alone gives"),
        (gloo_counted_as_training, r"peer is late .*said \('backward', 'compute'\).*what "
                                   r"counting gloo's threads' busy time as the training "
                                   r"thread's gives"),
        (any_collective, r"said \('backward', 'waiting for another rank'\); expected "
                         r"\('backward', 'compute'\): .*hidden under that compute.*A "
                         r"collective somewhere in the trace is not a wait"),
        (whole_trace_share, r"broadcast from another rank, diagnose said \('data', 'loading'\)"
                            r".*sat in a broadcast for 90% .*only 45% of the step.*whole-trace "
                            r"measure hides a wait"),
        (whole_trace_against_compute, r"broadcast from another rank, diagnose said \('data', "
                                      r"'loading'\).*whole-trace measure hides a wait"),
        (whole_trace_against_the_phase, r"naive data parallelism .*said \('data', 'waiting for "
                                        r"another rank'\).*\(37% of the step\) is in the "
                                        r"'communication' phase.*not over the whole trace"),
        (idle_is_waiting, r"one process .*said \('data', 'waiting for another rank'\).*no "
                          r"operator for 95% .*an idle training thread is not waiting"),
        (most_operators, r"one process .*diagnose named the phase 'backward', but the longest "
                         r"is 'data' \(median phase times per step: data 40\.0 ms"),
        (phase_only, r"diagnose returned 'backward' for the trace of .*return a pair of strings"),
        (short_cause, r"the cause 'waiting'; say one of \['loading', 'waiting for another "
                      r"rank', 'compute'\], exactly"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_bottleneck_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("06.bottleneck", wrong)


def test_bottleneck_cases_are_what_they_were_built_to_be(tmp_path):
    # labkit's diagnose finds each built answer; the two 'data' traces share their phase times
    cases = exprof.bottleneck_cases()
    traces = {c.key: exprof.build_trace(c, tmp_path) for c in cases}
    for c in cases:
        found = overlap.diagnose(traces[c.key])
        assert (found.phase, found.cause) == c.want, (c.key, found.describe())
    assert traces["P"].phase_seconds(profiling.PHASES) == traces["Q"].phase_seconds(profiling.PHASES)
    assert exprof.reference_diagnose(traces["P"]) != exprof.reference_diagnose(traces["Q"])
    # every named mistake's message exists for the answer that mistake gives
    for key, wrong in [("R", fixed_cause), ("T", cause_from_the_name), ("R", any_collective),
                       ("Q", whole_trace_share), ("U", whole_trace_against_the_phase),
                       ("S", idle_is_waiting)]:  # fmt: skip
        case = next(c for c in cases if c.key == key)
        got = wrong(traces[key])
        assert got[1] != case.want[1], (key, wrong.__name__)
        assert exprof._cause_hint(case, got[1], traces[key], overlap.diagnose(traces[key]))


LATE_S = 0.03  # how late the peer joins; how long the other trace's data phase sleeps


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two real traces with 'data' longest: the training thread sleeping in it (no collective
    anywhere), and blocked in a real gloo all-reduce whose peer (a second ProcessGroupGloo in
    this process, on a thread) arrives LATE_S late. Forward and backward compute a little."""
    assert not tdist.is_initialized(), "another test left a default process group"
    torch.set_num_threads(1)
    store = tdist.HashStore()
    pair: list = [None, None]

    def join(r: int) -> None:
        pair[r] = tdist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=60))

    starters = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    x0, x1 = torch.ones(1024), torch.ones(1024)
    a = torch.randn(64, 64)

    def late_peer() -> None:
        time.sleep(LATE_S)
        pair[1].allreduce([x1]).wait()

    def work() -> None:
        for name in ("forward", "backward", "optimizer"):
            with phase(name):
                for _ in range(5):
                    a @ a

    def sleeping(i: int) -> None:
        with phase("data"):
            time.sleep(LATE_S)
        work()

    def waiting(i: int) -> None:
        with phase("data"):
            peer = threading.Thread(target=late_peer)
            peer.start()
            pair[0].allreduce([x0]).wait()
            peer.join()
        work()

    out = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, step in (("sleeping", sleeping), ("waiting", waiting)):
                run = profiling.profile_steps(step, wait=0, warmup=1, active=3,
                                              trace_dir=tmp_path_factory.mktemp(name))
                out[name] = profiling.load_trace(run.traces[0])
    finally:
        pair.clear()
    return out


def test_diagnose_tells_a_sleep_from_a_real_gloo_wait(recorded):
    sleeping, waiting = recorded["sleeping"], recorded["waiting"]
    assert exprof.reference_diagnose(sleeping) == ("data", "loading"), overlap.diagnose(sleeping).describe()
    assert exprof.reference_diagnose(waiting) == ("data", WAIT), overlap.diagnose(waiting).describe()
    # the wait is gloo's range on a thread of its own, not the training thread's
    gloo = waiting.spans(name="gloo:all_reduce")
    assert gloo and waiting.main_tid not in {s.tid for s in gloo}
    # the mistakes the check names give the wrong answer on these real traces too
    assert idle_is_waiting(sleeping)[1] == WAIT and cause_from_the_name(waiting)[1] == "loading"
    assert gloo_counted_as_training(waiting)[1] == "loading"


def test_diagnose_refuses_a_trace_without_phases(tmp_path):
    case = exprof.bottleneck_cases()[0]
    bare = exprof.BottleneckCase("bare", "no phases", case.want,
                                 tuple((f"step part {k}", ms, pieces)
                                       for k, (_, ms, pieces) in enumerate(case.phases)))  # fmt: skip
    with pytest.raises(profiling.TraceError, match=r"none of the phases .* annotate the step"):
        overlap.diagnose(exprof.build_trace(bare, tmp_path))
