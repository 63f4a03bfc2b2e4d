import ast
import dataclasses
import inspect
import re
import signal
import textwrap
import time
import timeit
from time import perf_counter

import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook

from labkit import timing
from labkit.config import ModelConfig
from labkit.course import exercises as ex
from labkit.course import nbgen
from labkit.course.exercises import feedback, single_gpu
from labkit.course.exercises import registry as exercise_registry

# --------------------------------------------------------------------------- reference answers,
# written the way the solution notebook marks them, so the same source yields the stub.

SOLUTIONS = {
    "01.param_count": """
def count_params(cfg):
    # BEGIN SOLUTION
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
def test_the_generated_stub_is_not_done_and_gives_nothing_away(exercise_id, capsys):
    stub = stub_of(SOLUTIONS[exercise_id])
    assert "NotImplementedError" in stub and "BEGIN SOLUTION" not in stub
    assert f'raise NotImplementedError("{ex.STUB_MESSAGE}")' in stub  # no hint, no answer
    # verify() raises, so workers and tests can tell "not done" from "wrong"
    with pytest.raises(ex.ExerciseIncomplete) as info:
        ex.verify(exercise_id, run_cell(stub))
    assert str(info.value) == f"Exercise {exercise_id} is not done yet: {ex.get(exercise_id).hints[0]}"
    assert info.value.exercise_id == exercise_id
    assert isinstance(info.value, NotImplementedError)
    # check() does not: one friendly line, and the notebook carries on
    got = ex.check(exercise_id, run_cell(stub))
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"○ {exercise_id} (")
    assert "not done yet" in out and ex.get(exercise_id).hints[0] in out
    assert f'ex.hint("{exercise_id}")' in out
    assert got is ex.get(exercise_id).reference  # the reference, or None if nothing uses it


def test_registry_lists_and_rejects():
    assert [e.id for e in ex.catalogue("01")] == ["01.adam_bytes", "01.batch_plan",
                                                   "01.param_count", "01.timed"]
    assert all(e.notebook == "01" and e.title and len(e.hints) >= 2 for e in ex.catalogue("01"))
    with pytest.raises(ValueError, match=r"exercise_id='01.nope' is not an exercise; known: \["):
        ex.check("01.nope", None)
    with pytest.raises(ValueError, match="already registered"):
        ex.exercise("01.timed", "t", ("h",))
    with pytest.raises(ValueError, match=r"use 'NN\.name'"):
        ex.exercise("timed", "t", ("h",))


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
        ex.verify("01.param_count", wrong)
    message = str(info.value)
    assert "expected 120,576 parameters" in message  # the first config, counted from the model
    assert "got " in message and diagnosis in message


def test_param_count_checks_every_config():
    # Right for the first configuration only: a single-shape check would pass this.
    first = single_gpu.PARAM_COUNT_CONFIGS[0]
    with pytest.raises(ex.ExerciseFailed, match="vocab_size=100"):
        ex.verify("01.param_count", lambda c: correct_count(first))


def test_param_count_wants_an_int_and_a_function():
    with pytest.raises(ex.ExerciseFailed, match=r"returned float .* return an int"):
        ex.verify("01.param_count", lambda c: float(correct_count(c)))
    with pytest.raises(ex.ExerciseFailed, match="got int 120576; pass the function itself"):
        ex.verify("01.param_count", 120576)


def test_errors_in_learner_code_are_reported_as_failures():
    def count_params(cfg):
        return cfg.hidden_size  # not a field

    with pytest.raises(
        ex.ExerciseFailed,
        match=r"count_params\(ModelConfig\(.*\)\) raised "
        r"AttributeError",
    ) as info:
        ex.verify("01.param_count", count_params)
    assert isinstance(info.value.__cause__, AttributeError)
    # the learner's own line, not labkit's frames, is what the message points at
    assert "line" in str(info.value) and "return cfg.hidden_size" in str(info.value)


# --------------------------------------------------------------------------- check() never stops Run All


def test_a_wrong_answer_is_diagnosed_in_print_and_later_cells_get_the_reference(capsys):
    got = ex.check("01.adam_bytes", lambda n: 12 * n)
    out = capsys.readouterr().out
    assert out.startswith("✗ 01.adam_bytes (") and "12 per parameter" in out
    assert "Later cells use the reference answer" in out
    assert got is single_gpu.reference_adamw_state_bytes and got(10) == 160
    assert ex.whose("01.adam_bytes") == "the reference answer"


def test_a_passing_answer_is_what_later_cells_use_and_it_says_so(capsys):
    def mine(n):
        return 16 * n

    assert ex.check("01.adam_bytes", mine) is mine
    assert "Later cells use your answer" in capsys.readouterr().out
    assert ex.whose("01.adam_bytes") == "your answer"
    # an exercise nothing later depends on returns None: a cell ending in a check shows nothing
    assert ex.check("01.param_count", correct_count) is None


def test_hints_come_in_steps_ending_with_the_recipe(capsys, monkeypatch):
    monkeypatch.setattr(feedback, "_HINTS_SHOWN", {})
    hints = ex.get("01.timed").hints
    ex.hint("01.timed")
    first = capsys.readouterr().out
    assert first.startswith(f"Hint 1 of {len(hints)} for 01.timed: {hints[0]}")
    for level in range(2, len(hints) + 1):
        ex.hint("01.timed")
        assert capsys.readouterr().out.startswith(f"Hint {level} of {len(hints)}")
    ex.hint("01.timed")  # past the end: the recipe again, said to be the last
    out = capsys.readouterr().out
    assert hints[-1] in out and "last hint" in out and hints[-1].startswith("recipe")
    with pytest.raises(ValueError, match="has hints 1 to"):
        ex.hint("01.timed", level=len(hints) + 1)


def test_not_done_counts_as_the_first_hint_shown(capsys, monkeypatch):
    monkeypatch.setattr(feedback, "_HINTS_SHOWN", {})
    ex.check("01.param_count", run_cell(stub_of(SOLUTIONS["01.param_count"])))
    capsys.readouterr()
    ex.hint("01.param_count")
    assert capsys.readouterr().out.startswith("Hint 2 of ")


@pytest.mark.parametrize("exercise", ex.catalogue(), ids=lambda e: e.id)
def test_every_exercise_has_graded_hints_whose_first_is_not_the_recipe(exercise):
    first, *_, last = exercise.hints
    assert len(exercise.hints) >= 3, "a conceptual hint, more on request, the recipe last"
    assert last.startswith("recipe")
    assert "recipe" not in first and len(set(exercise.hints)) == len(exercise.hints)


# --------------------------------------------------------------------------- the last hint guides
# Issue 30 item 5: the recipe is steps in words that guide, never the solution: no code, no
# call sequence, no closed-form formula that is itself the answer.

CODE_PATTERNS = {
    "an assignment or keyword argument (a lone `=`)": re.compile(r"(?<![=<>!≤≥])=(?![=>])"),
    "a call written as code, name(...)": re.compile(r"(?<![\w.])[A-Za-z_][\w.]*\("),
    "a library's or an object's attribute written as code":
        re.compile(r"\b(?:self|torch|dist|F|nn|np|math|statistics)\.\w"),
    "Python syntax (lambda, //, **, +=, ->, indexing, a code span)":
        re.compile(r"\blambda\b|//|\*\*|[+\-*/]=|->|\w\[|`"),
}  # fmt: skip
# Four or more operands joined by arithmetic (a hyphen only with spaces around it, so that
# "warm-up" or "log-sum-exp" is a word): V·h + s·h + ..., (m+p−1)/m, a * b / c * d.
_OPERAND = r"[(\[]*[\w.²³√']{1,24}[)\]]*"
_OPERATOR = r"\s*(?:[+−·×*/^]|(?<=\s)-(?=\s))\s*"
FORMULA = re.compile(rf"{_OPERAND}(?:{_OPERATOR}{_OPERAND}){{3,}}")


def _normalised(text: str) -> str:
    return re.sub(r"\s+", "", text.replace("·", "*").replace("×", "*").replace("−", "-"))


def reference_expressions(reference) -> list[str]:
    """The expressions the exercise's reference answer computes (what it returns or assigns),
    normalised: a hint that contains one hands over the reference's own code."""
    if not inspect.isfunction(reference):
        return []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(reference)))
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Return | ast.Assign) else None
        if value is not None and not isinstance(value, ast.Constant):
            text = _normalised(ast.unparse(value))
            if len(text) >= 12:  # "fits", "None": too short to be a solution's code
                found.append(text)
    return found


def code_like(text: str, reference=None) -> list[str]:
    """What in ``text`` reads as code or as the answer's formula (empty: it reads as words)."""
    found = [f"{what}: {m.group(0)!r}" for what, rx in CODE_PATTERNS.items()
             if (m := rx.search(text))]  # fmt: skip
    if m := FORMULA.search(text):
        found.append(f"a closed-form formula: {m.group(0)!r}")
    body = _normalised(text)
    found += [f"the reference's own code: {e!r}" for e in reference_expressions(reference) if e in body]
    return found


# Last hints known to hand over code, each marked xfail (strict: the day one is fixed, its XPASS
# fails here and its line must go). None today: every recipe guides in words (issue 30 item 5).
RECIPE_IS_CODE: dict[str, str] = {}


def _recipe_cases() -> list:
    cases = []
    for e in ex.catalogue():
        marks = ([pytest.mark.xfail(strict=True, reason=RECIPE_IS_CODE[e.id])]
                 if e.id in RECIPE_IS_CODE else [])  # fmt: skip
        cases.append(pytest.param(e, id=e.id, marks=marks))
    return cases


@pytest.mark.parametrize("exercise", _recipe_cases())
def test_the_last_hint_guides_in_words_without_handing_over_the_solution(exercise):
    recipe = exercise.hints[-1]
    assert recipe.startswith("recipe:")
    assert code_like(recipe, exercise.reference) == [], recipe


def test_the_code_rule_tells_yesterdays_recipes_from_todays():
    """The rule flags the recipes these exercises had before (code, a call sequence, the
    answer's formula) and passes recipes in words: it is not vacuous."""
    from labkit.course.exercises import planning

    bad = [
        "recipe: return 2 * (n_ranks - 1) / n_ranks * numel * bytes_per_element",
        "recipe: V·h + s·h + L·(12h² + 13h) + 2h, with V = vocab_size, s = seq_len",
        "recipe: 4 (weight) + 4 (gradient) + 4 + 4 (the two moments) = 16 bytes per parameter",
        "recipe: synchronize, read time.perf_counter(), call fn(), synchronize again",
        "recipe: warm-up = min(p − 1 − stage, m) forwards; then one forward, one backward",
        "recipe: k = out_features // world_size; return x @ Wᵀ + b with them",
        "recipe: write its step as (m+p−1)/m times T plus (m+p−1) times c",
        'recipe: forward: Leave.apply(F.linear(F.gelu(self.fc(Enter.apply(x))), self.proj.weight))',
        "recipe: tau = math.sqrt(2 * blocking_s * mtbf_s); return tau, waste",
    ]
    for text in bad:
        assert code_like(text), text
    copied = "recipe: keep [p for p in predictions if p.memory['total'] <= usable_memory * memory_bytes]"
    assert any("reference's own code" in why
               for why in code_like(copied, planning.reference_choose_layout))  # fmt: skip
    good = [
        ex.get("00.bucket_size").hints[-1],  # n·α·β: a quantity named, not the answer
        ex.get("01.batch_plan").hints[-1],
        "recipe: begin with the warm-up, forwards only; then alternate; last, the log-sum-exp "
        "of the all-to-all's non-overlapping warm-up backwards, oldest first",
    ]
    for text in good:
        assert code_like(text) == [], text


def test_is_stub_reads_the_source_of_functions_and_classes(tmp_path):
    path = tmp_path / "learner.py"
    path.write_text(
        "import torch\n"
        "def done(x):\n    return x\n"
        f"def todo(x):\n    raise NotImplementedError({ex.STUB_MESSAGE!r})\n"
        "def raises_later(x):\n    if x:\n        raise NotImplementedError('mine')\n    return x\n"
        "class Half(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return x\n"
        f"    @staticmethod\n    def backward(ctx, g):\n        raise NotImplementedError('x')\n"
    )
    from labkit.course.exercises.model_parallel import load_file

    m = load_file(path)
    assert not ex.is_stub(m.done) and ex.is_stub(m.todo)
    assert not ex.is_stub(m.raises_later)  # only a top-level raise is the stub
    assert ex.is_stub(m.Half) and ex.is_stub((m.done, m.todo)) and not ex.is_stub(42)


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
        ex.verify("01.timed", wrong)


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
        ex.verify("01.timed", timed_without_sync)
    with pytest.raises(ex.ExerciseFailed):
        ex.verify("01.timed", lambda fn, device: 1 / 0)
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
        (12, "one kind of fp32 tensor per parameter is missing"),
        (4, "fp32 weights alone"),
        (128, "that is bits"),
        (2, "16-bit weights"),
        (18, "returned 18 bytes, 18 per parameter: that is not the model states"),
    ],
)
def test_adam_bytes_names_the_mistake_without_giving_the_answer(per_param, message):
    with pytest.raises(ex.ExerciseFailed, match=message) as info:
        ex.verify("01.adam_bytes", lambda n: per_param * n)
    assert "16" not in str(info.value).replace("16-bit", "")  # the answer is never printed


def test_adam_bytes_wants_an_int():
    with pytest.raises(ex.ExerciseFailed, match="returned float"):
        ex.verify("01.adam_bytes", lambda n: n * 16.0)


def test_an_exercise_id_that_is_not_a_string_or_not_known_is_named(capsys):
    with pytest.raises(TypeError, match=r"exercise_id=1 is not a string: .*ex.check\(\"01.param_count\""):
        ex.check(1, lambda cfg: 0)
    with pytest.raises(ValueError, match=r"exercise_id='09.nope' is not an exercise; known: \[.*'02.allreduce_grads'"):
        ex.check("09.nope", lambda cfg: 0)
    assert capsys.readouterr().out == ""


def test_a_learner_function_that_never_returns_is_stopped_by_the_checks_time_limit(
    monkeypatch, capsys
):
    monkeypatch.setitem(exercise_registry._REGISTRY, "01.param_count",
                        dataclasses.replace(ex.get("01.param_count"), time_limit_s=1.0))  # fmt: skip
    # pytest-timeout's own SIGALRM timer (when it uses one) must survive the check's.
    handler_before, timer_before = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)

    def count_params(cfg):
        total = 0
        while total >= 0:  # never false
            total += 1
        return total

    assert ex.check("01.param_count", count_params) is None
    out = capsys.readouterr().out
    assert out.startswith("✗ 01.param_count"), out
    assert "your code did not finish within 1 s, the check's time limit" in out
    assert "while it ran (at test_exercises.py, line" in out
    assert "total += 1" in out or "while total >= 0" in out
    assert signal.getsignal(signal.SIGALRM) is handler_before, "the timer's handler is put back"
    assert signal.getitimer(signal.ITIMER_REAL)[0] == pytest.approx(timer_before[0], abs=30)
    # The learner's `except Exception` cannot swallow it.
    def swallowing(cfg):
        while True:
            try:  # noqa: SIM105 (a learner's code, written as learners write it)
                time.sleep(0.05)
            except Exception:
                pass

    ex.check("01.param_count", swallowing)
    assert "did not finish within 1 s" in capsys.readouterr().out


def test_a_paused_time_limit_lets_a_worker_job_run_on_its_own_limit():
    with ex.time_limit(0.3):
        with ex.time_limit_paused():
            time.sleep(0.5)  # longer than the limit: paused, so nothing is raised
        with pytest.raises(ex.TimeLimitReached):
            time.sleep(1.0)  # the clock runs again


def test_a_raising_learner_call_shows_its_arguments_briefly():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])

    def broken(m, x):
        raise ValueError("nope")

    with pytest.raises(ex.ExerciseFailed) as info:
        ex.call(broken, model, torch.zeros(3, 4), name="x" * 500)
    message = str(info.value)
    assert message.startswith("broken(<Sequential model>, <tensor (3, 4) float32>, name='xxx")
    assert "Linear(" not in message and len(message) < 400


def _job_result(tmp_path):
    from labkit.jobs import launch

    return launch.JobResult(module="w", job_id="j", nproc=2, backend="gloo", device="cpu",
                            ranks=[{}, {}], wall_s=1.0, log_dir=tmp_path, status="failed",
                            returncode=1)  # fmt: skip


def test_a_worker_check_that_did_not_finish_is_worded_from_the_most_telling_evidence(tmp_path):
    from labkit.jobs import launch

    result = _job_result(tmp_path)
    # Rank 0 waits in a torch collective, rank 1 loops in the learner's code: a mismatch.
    hung = launch.JobTimeout(
        "w timed out after 90.0 s (timeout_s=90); likely hung: rank 1", result=result, ranks=[1],
        heartbeats={}, where={0: "mp.py, line 3, in f: `dist.all_reduce(x)`, inside all_reduce (torch)",
                              1: "mp.py, line 5, in f: `while True:`"},
    )  # fmt: skip
    text = ex.explain_job_error(hung, {})
    assert text.startswith("the check did not finish (timed out after 90.0 s (timeout_s=90))")
    assert "rank 0 waited in a torch call (a collective?) that rank 1 never reached" in text
    assert "rank 1 was at mp.py, line 5, in f: `while True:`" in text
    # Both ranks in the learner's own loop.
    looping = launch.JobTimeout("w timed out", result=result, ranks=[], heartbeats={},
                                where={0: "mp.py, line 5, in f", 1: "mp.py, line 5, in f"})  # fmt: skip
    assert "your code never returned: a loop whose condition never changes?" in ex.explain_job_error(looping, {})
    # A rank's own report beats its peer's "connection closed", which is only an echo.
    failed = launch.JobFailed("w failed on rank 0: RuntimeError: Connection closed by peer",
                              result=result, rank=0, exc_type="RuntimeError",
                              exc_message="Connection closed by peer [127.0.0.1]:1")  # fmt: skip
    reports = {0: "on rank 0: raised RuntimeError: Connection closed by peer",
               1: "on rank 1: it was never all-reduced"}  # fmt: skip
    text = ex.explain_job_error(failed, reports)
    assert text.startswith("on rank 1: it was never all-reduced. Then rank 0 failed, waiting in a "
                           "collective that rank 1 never called")  # fmt: skip
    # A rank that died outright is the cause, whatever the others reported about it.
    died = launch.JobFailed("w failed on rank 1", result=result, rank=1, exitcode=-9,
                            kind="died", exc_message="the process was killed by SIGKILL")  # fmt: skip
    text = ex.explain_job_error(died, reports)
    assert text.startswith("the check job failed on rank 1: the process was killed by SIGKILL")


def test_code_that_swallows_every_exception_is_stopped_again_and_again(monkeypatch, capsys):
    """A bare `except:` catches the first stop; the time limit raises again every RETRY_S, so
    a learner's loop over such blocks still ends, and the learner is told why once."""
    monkeypatch.setitem(exercise_registry._REGISTRY, "01.param_count",
                        dataclasses.replace(ex.get("01.param_count"), time_limit_s=1.0))  # fmt: skip

    def count_params(cfg):
        for _ in range(2):
            try:
                while True:
                    pass
            except:  # noqa: E722 (a learner's code, written as learners write it)
                pass
        while True:
            pass

    ex.check("01.param_count", count_params)
    out = capsys.readouterr().out
    assert out.count("labkit: the check's time limit is reached and your code caught") == 1, out
    assert "✗ 01.param_count" in out and "did not finish within 1 s" in out


def test_expect_solved_makes_a_check_that_does_not_pass_raise(monkeypatch, capsys):
    """LABKIT_EXPECT_SOLVED=1 (complete notebooks under test): not done or wrong raises after
    its line is printed; a pass returns as always; without it nothing raises."""
    exercise_id = "01.adam_bytes"
    reference = ex.get(exercise_id).reference

    def stub(n_params):
        raise NotImplementedError(ex.STUB_MESSAGE)

    monkeypatch.setenv(ex.EXPECT_SOLVED, "1")
    assert ex.check(exercise_id, reference) is reference
    for answer, why in ((stub, "is not done yet"), (lambda n_params: 0, "adamw_state_bytes(1) returned 0")):
        with pytest.raises(ex.NotSolved, match=r"01\.adam_bytes did not pass") as raised:
            ex.check(exercise_id, answer)
        said = str(raised.value).split("The check said: ")[1]  # the reason reaches the test log
        assert why in said, said
    out = capsys.readouterr().out
    assert "○ 01.adam_bytes (" in out and "✗ 01.adam_bytes (" in out
    monkeypatch.delenv(ex.EXPECT_SOLVED)
    assert ex.check(exercise_id, stub) is reference  # a learner's copy: a line, no error


def test_the_learners_line_is_found_in_the_exercise_workspace(tmp_path):
    """The %%writefile files live in labkit_home()/exercises/NN, a folder called labkit:
    their frames are the learner's, only the package's own files are not."""
    import importlib.util

    folder = tmp_path / ".cache" / "labkit" / "exercises" / "02"
    folder.mkdir(parents=True)
    (folder / "mine.py").write_text("def boom():\n    return 1 / 0\n", encoding="utf-8")
    spec = importlib.util.spec_from_file_location("mine", folder / "mine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ZeroDivisionError) as err:
        module.boom()
    assert ex.learner_frame(err.value) == " (at mine.py, line 2: return 1 / 0)"
    with pytest.raises(ex.ExerciseFailed, match=r"mine\.py, line 2"):
        ex.call(module.boom)
