"""Notebook 00's exercise check: it passes on the solution, says "not done" on the stub, and
names each usual mistake."""

from __future__ import annotations

import math

import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit.course import exercises as ex
from labkit.course.exercises import first_job

# The solution cell of notebook 00, less its ex.check line (same source, so the same stub).
SOLUTIONS = {
    "00.ring_bytes": """
def ring_bytes_sent(numel: int, n_ranks: int, bytes_per_element: int = 4) -> float:
    \"\"\"Bytes one rank sends in a ring all-reduce of numel elements over n_ranks ranks.\"\"\"
    # BEGIN SOLUTION
    chunk = numel * bytes_per_element / n_ranks  # the message cut into one chunk per rank
    steps = 2 * (n_ranks - 1)  # reduce-scatter, then all-gather: p - 1 steps each
    return steps * chunk
    # END SOLUTION
answer = ring_bytes_sent
""",
    "00.bucket_size": """
def bucket_bytes(alpha_s: float, beta: float, n_ranks: int, share: float = 0.8) -> float:
    \"\"\"The smallest ring all-reduce, in bytes, whose α–β algbw reaches `share` of its limit.\"\"\"
    # BEGIN SOLUTION
    # algbw(S) = S / (2(n−1)(α + S/(nβ))) tends to nβ/(2(n−1)); their ratio is S / (S + nαβ)
    return share / (1 - share) * n_ranks * alpha_s * beta
    # END SOLUTION
answer = bucket_bytes
""",
}
SECRETS = {"00.ring_bytes": ("2 * (n_ranks - 1)", "steps * chunk"),
           "00.bucket_size": ("1 - share", "S / (S + nαβ)")}


def test_the_catalogue_of_notebook_00():
    assert [e.id for e in ex.catalogue("00")] == sorted(SOLUTIONS)
    assert all(e.reference is not None for e in ex.catalogue("00"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_solution_passes(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_stub_is_not_done(exercise_id, capsys):
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys,
                            secrets=SECRETS[exercise_id])  # fmt: skip


def whole_message(numel, n_ranks, bytes_per_element=4):
    return numel * bytes_per_element


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (whole_message, "right on 2 ranks only"),
        (lambda numel, p, e=4: 2 * numel * e, "whole message twice"),
        (lambda numel, p, e=4: (p - 1) / p * numel * e, "reduce-scatter alone"),
        (lambda numel, p, e=4: 2 * (p - 1) * numel * e, "whole message twice"),  # 2 ranks: 2S
        (lambda numel, p, e=4: 2 * (p - 1) / p * numel, "counts elements, not bytes"),
        (lambda numel, p, e=4: 2 * (p - 1) / p * numel * 4, "passes bytes_per_element=2"),
        (lambda numel, p, e=4: 2 * (p - 1) * numel * e if p > 2 else numel * e,
         "what all p ranks send together"),
        (lambda numel, p, e=4: 2 * (p - 1) * numel * e + 1, "count per phase"),
    ],
    ids=["whole", "twice", "half-phase", "whole-per-step", "elements", "fixed-4-bytes",
         "all-ranks", "other"],
)
def test_each_usual_mistake_is_named(wrong, says):
    with pytest.raises(ex.ExerciseFailed, match=says):
        ex.verify("00.ring_bytes", wrong)


def test_a_failure_names_the_case_and_the_learners_value_but_not_the_target():
    # 3 ranks, 3000 float32 elements: the target is 2·2/3·12000 = 8000 bytes; whole_message
    # returns 12000. The message must carry the case and 12,000, never 8,000.
    with pytest.raises(ex.ExerciseFailed) as failed:
        ex.verify("00.ring_bytes", whole_message)
    said = str(failed.value)
    assert "whole_message(3000, 3, 4)" in said and "12,000" in said
    assert "8,000" not in said and "8000" not in said


def test_the_whole_message_passes_two_ranks_and_fails_three():
    # the point of the cases: on the notebook's 2 ranks S is right, so the check cannot stop there
    assert whole_message(2**16, 2) == first_job.reference_ring_bytes_sent(2**16, 2)
    with pytest.raises(ex.ExerciseFailed, match=r"ring_bytes_sent|whole_message\(3000, 3, 4\)"):
        ex.verify("00.ring_bytes", whole_message)


def test_answers_that_are_not_numbers_or_raise_are_reported():
    with pytest.raises(ex.ExerciseFailed, match="return a number of bytes"):
        ex.verify("00.ring_bytes", lambda numel, p, e=4: "1024")
    with pytest.raises(ex.ExerciseFailed, match="ZeroDivisionError"):
        ex.verify("00.ring_bytes", lambda numel, p, e=4: numel / 0)
    with pytest.raises(ex.ExerciseFailed, match="pass the function itself"):
        ex.verify("00.ring_bytes", 42)


# --------------------------------------------------------------------------- 00.bucket_size


def right_bucket(a, b, n, s=0.8):
    return s / (1 - s) * n * a * b


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (lambda a, b, n, s=0.8: s / (1 - s) * a * b, "ONE point-to-point message"),
        (lambda a, b, n, s=0.8: 2 * (n - 1) * s / (1 - s) * a * b, "whole message"),
        (lambda a, b, n, s=0.8: 2 * right_bucket(a, b, n, s), "gloo's 4\\(n−1\\) messages"),
        (lambda a, b, n, s=0.8: a * b, "Hockney"),
        (lambda a, b, n, s=0.8: n * a * b, "half of the limit whatever share"),
        (lambda a, b, n, s=0.8: s * n * a * b, "share enters the wrong way"),
        (lambda a, b, n, s=0.8: (1 - s) / s * n * a * b, "upside down"),
        (lambda a, b, n, s=0.8: 8 * right_bucket(a, b, n, s), "bits"),
        (lambda a, b, n, s=0.8: right_bucket(a, b, n, s) / 4, "float32 elements"),
        (lambda a, b, n, s=0.8: right_bucket(a, b, n, s) / 1e9, "GB"),
        (lambda a, b, n, s=0.8: right_bucket(a, b, n, s) * 1e6, "not µs"),
        (lambda a, b, n, s=0.8: 2.06e6, "write the all-reduce's time"),  # this machine's, fixed
    ],
    ids=["one-message", "whole-per-step", "gloo-4", "hockney", "half", "share-times",
         "share-inverted", "bits", "elements", "GB", "alpha-us", "hard-coded"],
)
def test_each_usual_bucket_mistake_is_named(wrong, says):
    with pytest.raises(ex.ExerciseFailed, match=says) as failed:
        ex.verify("00.bucket_size", wrong)
    said = str(failed.value)
    a, b, n, s = next(c for c in first_job.BUCKET_CASES if f"({c[0]:g}, {c[1]:g}, {c[2]}," in said)
    right = first_job.reference_bucket_bytes(a, b, n, s)
    assert f"{right:,.6g}" not in said  # the diagnosis, never the target


def test_a_bucket_rounded_to_whole_elements_passes():
    assert "share of its bandwidth limit" in ex.verify(
        "00.bucket_size", lambda a, b, n, s=0.8: 4 * n * math.ceil(right_bucket(a, b, n, s) / (4 * n)))


def test_a_bucket_that_is_not_a_number_is_reported():
    with pytest.raises(ex.ExerciseFailed, match="return a number of bytes"):
        ex.verify("00.bucket_size", lambda a, b, n, s=0.8: None)


def _times(median_s, n=15, spread=0.02):
    return [median_s * (1 + spread * ((i % 5) - 2) / 2) for i in range(n)]


@pytest.mark.parametrize(
    ("quarter_s", "chosen_s", "says"),
    [
        # the large message: 8 MiB in 10 ms; the plan 1 MiB, its pace at 80%: 1.5625 ms
        (1.2e-3, 1.4e-3, "the plan held"),  # the quarter's pace at 80%: 0.39 ms
        (1.2e-3, 3.0e-3, "falls short"),
        (0.3e-3, 1.4e-3, "so does a quarter of it"),
    ],
)
def test_the_bucket_verdict_is_chosen_by_the_measurements(quarter_s, chosen_s, says):
    sizes = [2**18, 2**20, 2**23]
    text = first_job.judge_bucket_plan(sizes, [_times(quarter_s), _times(chosen_s), _times(10e-3)], 0.8)
    assert says in text.splitlines()[-1]
    from labkit import verdict

    assert verdict.contradictions(text) == []


def test_noisy_bucket_times_say_so_and_do_not_fail_anyone():
    sizes = [2**18, 2**20, 2**23]
    noisy = [1e-3, 4e-3, 1.5e-3, 3e-3, 0.8e-3, 2.5e-3, 1.2e-3, 3.5e-3]
    text = first_job.judge_bucket_plan(sizes, [noisy, noisy, _times(10e-3, 8)], 0.8)
    assert "too noisy to tell" in text.splitlines()[-1]


ENDINGS = ("the plan held", "falls short", "so does a quarter of it", "too noisy to tell",
           "whether a quarter of it falls short is too noisy")


@pytest.mark.slow
def test_a_planned_bucket_runs_for_real_on_two_ranks(capsys):
    text = first_job.run_bucket_plan(2**18, 2, 0.8, rounds=5)
    lines = text.splitlines()
    assert "ran on 2 ranks over gloo: 5 rounds of all-reduces of 64 KiB, 256 KiB, 2 MiB" in lines[0]
    assert any(e in lines[-1] for e in ENDINGS)
    assert sum(line.startswith("verdict: ") for line in lines) == 2


def test_a_plan_no_all_reduce_can_have_runs_nothing():
    assert "nothing run" in first_job.run_bucket_plan(0.0, 2, 0.8)
    assert "nothing run" in first_job.run_bucket_plan(float("nan"), 2, 0.8)
