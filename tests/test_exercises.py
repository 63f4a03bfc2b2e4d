import time
import timeit
from time import perf_counter

import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook

from labkit import exercises as ex
from labkit import nbgen, timing
from labkit.config import ModelConfig

# --------------------------------------------------------------------------- reference answers,
# written the way the solution notebook marks them, so the same source yields the stub.

SOLUTIONS = {
    "01.param_count": """
def count_params(cfg):
    # BEGIN SOLUTION
    # HINT: embeddings, L blocks of 12h² + 13h, final LayerNorm; the head is tied
    h, L, V, s = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    return V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h
    # END SOLUTION
answer = count_params
""",
    "01.timed": """
import time
from labkit import timing

def timed(fn, device):
    # BEGIN SOLUTION
    # HINT: synchronize, clock, fn(), synchronize, clock
    timing.synchronize(device)
    start = time.perf_counter()
    fn()
    timing.synchronize(device)
    return time.perf_counter() - start
    # END SOLUTION
answer = timed
""",
    "01.adam_bytes": """
def adamw_state_bytes(n_params):
    # BEGIN SOLUTION
    return n_params * (4 + 4 + 4 + 4)  # weights, grads, exp_avg, exp_avg_sq (fp32)
    # END SOLUTION
answer = adamw_state_bytes
""",
}


def run_cell(source: str):
    namespace: dict = {}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace["answer"]


def stub_of(source: str) -> str:
    nb = nbgen.generate(new_notebook(cells=[new_code_cell(source, id="c")]))
    return nb.cells[0].source


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_check_passes_on_the_solution(exercise_id, capsys):
    ex.check(exercise_id, run_cell(SOLUTIONS[exercise_id]))
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {exercise_id}: ") and out.count("\n") == 1


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_check_on_the_generated_stub_says_not_done_with_a_hint(exercise_id):
    stub = stub_of(SOLUTIONS[exercise_id])
    assert "NotImplementedError" in stub and "BEGIN SOLUTION" not in stub
    with pytest.raises(ex.ExerciseIncomplete) as info:
        ex.check(exercise_id, run_cell(stub))
    message = str(info.value)
    assert message == f"Exercise {exercise_id} is not done yet: {ex.get(exercise_id).hint}"
    assert info.value.exercise_id == exercise_id
    assert isinstance(info.value, NotImplementedError)


def test_registry_lists_and_rejects():
    assert [e.id for e in ex.catalogue("01")] == ["01.adam_bytes", "01.param_count", "01.timed"]
    assert all(e.notebook == "01" and e.title and e.hint for e in ex.catalogue("01"))
    with pytest.raises(ValueError, match=r"exercise_id='01.nope' is not registered; known: \["):
        ex.check("01.nope", None)
    with pytest.raises(ValueError, match="already registered"):
        ex.exercise("01.timed", "t", "h")
    with pytest.raises(ValueError, match=r"use 'NN\.name'"):
        ex.exercise("timed", "t", "h")


def test_verify_returns_the_sentence_without_printing(capsys):
    said = ex.verify("01.adam_bytes", lambda n: 16 * n)
    assert "16·n" in said and capsys.readouterr().out == ""


def test_failures_are_assertion_errors_naming_the_exercise():
    with pytest.raises(AssertionError, match=r"^Exercise 01\.adam_bytes \(.*\) failed: ") as info:
        ex.verify("01.adam_bytes", lambda n: 12 * n)
    assert isinstance(info.value, ex.ExerciseFailed) and info.value.exercise_id == "01.adam_bytes"


# --------------------------------------------------------------------------- 01.param_count


def correct_count(cfg: ModelConfig) -> int:
    h, L, V, s = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    return V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h


@pytest.mark.parametrize(
    ("wrong", "diagnosis"),
    [
        (lambda c: correct_count(c) + c.vocab_size * c.d_model, "tied to the token embedding"),
        (lambda c: correct_count(c) - c.n_layer * 9 * c.d_model, "biases of the Linear layers"),
        (lambda c: correct_count(c) - c.seq_len * c.d_model, "position embedding"),
        (lambda c: correct_count(c) - 2 * c.d_model, "final LayerNorm"),
        (lambda c: correct_count(c) - c.n_layer * 13 * c.d_model, "not the 13h biases"),
        (lambda c: correct_count(c) + 1, "print(model)"),
    ],
)
def test_param_count_names_the_mistake(wrong, diagnosis):
    with pytest.raises(ex.ExerciseFailed) as info:
        ex.check("01.param_count", wrong)
    message = str(info.value)
    assert "expected 120,576 parameters" in message  # the first config, counted from the model
    assert "got " in message and diagnosis in message


def test_param_count_checks_every_config():
    # Right for the first configuration only: a single-shape check would pass this.
    first = ex.PARAM_COUNT_CONFIGS[0]
    with pytest.raises(ex.ExerciseFailed, match="vocab_size=100"):
        ex.check("01.param_count", lambda c: correct_count(first))


def test_param_count_wants_an_int_and_a_function():
    with pytest.raises(ex.ExerciseFailed, match=r"returned float .* return an int"):
        ex.check("01.param_count", lambda c: float(correct_count(c)))
    with pytest.raises(ex.ExerciseFailed, match="got int 120576; pass the function itself"):
        ex.check("01.param_count", 120576)


def test_errors_in_learner_code_are_reported_as_failures():
    def count_params(cfg):
        return cfg.hidden_size  # not a field

    with pytest.raises(
        ex.ExerciseFailed,
        match=r"count_params\(ModelConfig\(.*\)\) raised "
        r"AttributeError",
    ) as info:
        ex.check("01.param_count", count_params)
    assert isinstance(info.value.__cause__, AttributeError)


# --------------------------------------------------------------------------- 01.timed
# Learner-style functions live at module level: the check swaps clocks they name as globals.


def timed_without_sync(fn, device):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_without_first_sync(fn, device):
    start = time.perf_counter()
    fn()
    timing.synchronize(device)
    return time.perf_counter() - start


def timed_with_imported_names(fn, device):
    torch.cuda.synchronize(device)
    start = perf_counter()
    for _ in range(3):  # repeats, averaged: still right
        fn()
    torch.cuda.synchronize()
    return (perf_counter() - start) / 3


def timed_with_timeit_clock_in_ms(fn, device):
    timing.synchronize(device)
    start = timeit.default_timer()
    fn()
    timing.synchronize(device)
    return (timeit.default_timer() - start) * 1e3


def timed_without_clock(fn, device):
    fn()
    timing.synchronize(device)
    return 0.005


def test_timed_accepts_other_clocks_and_sync_calls(capsys):
    ex.check("01.timed", timed_with_imported_names)
    assert "✓ 01.timed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (
            timed_without_sync,
            r"returned 0\.001 ms, .*queued.* after fn\(\) and before reading "
            r"the end time",
        ),
        (
            timed_without_first_sync,
            r"returned 25\.000 ms for 5 ms of work.*before reading the "
            r"start time too",
        ),
        (timed_with_timeit_clock_in_ms, r"returned 5\.001 s .*in seconds"),
        (timed_without_clock, "fewer than two clock reads"),
        (lambda fn, device: 0.0, "never called fn"),
    ],
)
def test_timed_explains_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.check("01.timed", wrong)


def test_timed_restores_clocks_and_synchronize_even_after_a_failure():
    real = (
        time.perf_counter,
        time.time_ns,
        timeit.default_timer,
        timing.synchronize,
        torch.cuda.synchronize,
        globals()["perf_counter"],
    )
    with pytest.raises(ex.ExerciseFailed):
        ex.check("01.timed", timed_without_sync)
    with pytest.raises(ex.ExerciseFailed):
        ex.check("01.timed", lambda fn, device: 1 / 0)
    assert (
        time.perf_counter,
        time.time_ns,
        timeit.default_timer,
        timing.synchronize,
        torch.cuda.synchronize,
        globals()["perf_counter"],
    ) == real


# --------------------------------------------------------------------------- 01.adam_bytes


@pytest.mark.parametrize(
    ("per_param", "message"),
    [
        (12, "one of the four fp32 tensors is missing"),
        (4, "fp32 weights alone"),
        (128, "that is bits"),
        (2, "16-bit weights"),
        (18, r"got 18 \(18 per parameter\)$"),
    ],
)
def test_adam_bytes_names_the_mistake(per_param, message):
    with pytest.raises(ex.ExerciseFailed, match=message) as info:
        ex.check("01.adam_bytes", lambda n: per_param * n)
    assert "expected 16 bytes" in str(info.value)


def test_adam_bytes_wants_an_int():
    with pytest.raises(ex.ExerciseFailed, match="returned float"):
        ex.check("01.adam_bytes", lambda n: n * 16.0)
