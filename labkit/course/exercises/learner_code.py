"""The learner's code as a check sees it: still a stub or not, called safely, its lines named.

A check never shows a traceback: :func:`call` turns the learner's error into an
:class:`~.registry.ExerciseFailed` naming the learner's own line (:func:`learner_frame`, which
tells labkit's and the installed packages' frames from the learner's), and :func:`is_stub`
reads from the source whether the code is still the stub :mod:`labkit.course.nbgen` generated.
Apart from the runner because every notebook's checks use these helpers directly.
"""

from __future__ import annotations

import ast
import inspect
import numbers
import os
import sysconfig
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from labkit.course.exercises.registry import ExerciseFailed, ExerciseIncomplete, get

_STDLIB = sysconfig.get_paths()["stdlib"]
# labkit/course/exercises/learner_code.py -> labkit/: frames under it are the library's (moving
# this module to another depth must change the 2).
_PACKAGE = str(Path(__file__).resolve().parents[2]) + os.sep



STUB_MESSAGE = "exercise not done yet: replace this line with your code"
"""What the stubs :mod:`labkit.course.nbgen` generates raise: deliberately no hint, no answer."""



# --------------------------------------------------------------------------- stubs


def _body_raises_not_implemented(fn: Any) -> bool | None:
    """Whether ``fn``'s body has a top-level ``raise NotImplementedError``; None if unknown."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    for stmt in node.body:
        if isinstance(stmt, ast.Raise) and stmt.exc is not None:
            exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                return True
    return False


def is_stub(answer: Any) -> bool:
    """True if ``answer`` (a function, a class, or a tuple of them) still has a generated stub.

    Read from the source, so a check can say "not done yet" without running the learner's code
    (in a worker job, or where running it needs a process group). A function whose source
    cannot be read counts as done: its check will run it.
    """
    if isinstance(answer, tuple):
        return any(is_stub(a) for a in answer)
    if str(getattr(answer, "__module__", "")).split(".")[0] in ("torch", "labkit"):
        return False  # library code (torch.autograd.Function.forward raises by design)
    if inspect.isclass(answer):
        return any(is_stub(v.__func__ if isinstance(v, staticmethod | classmethod) else v)
                   for v in vars(answer).values() if inspect.isfunction(v)
                   or isinstance(v, staticmethod | classmethod))  # fmt: skip
    if inspect.isfunction(answer) or inspect.ismethod(answer):
        return bool(_body_raises_not_implemented(inspect.unwrap(answer)))
    return False


def incomplete(exercise_id: str) -> ExerciseIncomplete:
    """The error for a stub: "not done yet" and the first hint."""
    err = ExerciseIncomplete(f"Exercise {exercise_id} is not done yet: {get(exercise_id).hints[0]}")
    err.exercise_id = exercise_id
    return err



# --------------------------------------------------------------------------- helpers for checks


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the learner's ``fn``; any error but the stub's becomes an :class:`ExerciseFailed`.

    The message names the call, the error and the learner's own line that raised it (frames
    inside labkit and torch are left out): the check prints it instead of a traceback.
    ``NotImplementedError`` passes through, so :func:`verify` reports the exercise as not done.
    """
    __tracebackhide__ = True
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as err:
        shown = ", ".join([*map(short_repr, args),
                           *(f"{k}={short_repr(v)}" for k, v in kwargs.items())])  # fmt: skip
        raise ExerciseFailed(
            f"{callable_name(fn)}({shown}) raised {type(err).__name__}: {err}{learner_frame(err)}"
        ) from err


def short_repr(value: Any, limit: int = 160) -> str:
    """A one-line repr for messages: a model or a tensor by its kind and shape, never the
    30-line printout ``repr`` gives of a module."""
    try:
        import torch  # only to recognise modules and tensors: already loaded by any check
    except ImportError:  # pragma: no cover
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(value, torch.nn.Module):
        return f"<{type(value).__name__} model>"
    if torch is not None and isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_learners_file(path: str) -> bool:
    """Whether a traceback frame's file is the learner's code: not labkit's, not an installed
    package's (torch...), not the standard library's (a regex's or a sleep's frames)."""
    if any(part in path for part in ("/torch/", "-packages/", "<frozen")):
        return False
    # labkit's own files, by where the package is: the learner's files live in a folder
    # called labkit too (labkit_home()/exercises/NN), which a substring test would skip.
    return not (path.startswith(_STDLIB) or path.startswith(_PACKAGE))


def learner_frame(err: BaseException, prefix: str = "") -> str:
    """" (at <file>, line N: <code>)" for the last frame outside labkit and torch, or ""."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if is_learners_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f"{prefix} (at {Path(f.filename).name}, line {f.lineno}: {(f.line or '').strip()})"


def callable_name(fn: object) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def require_callable(answer: object, signature: str) -> Callable[..., Any]:
    if not callable(answer):
        raise ExerciseFailed(
            f"expected the function {signature}, got {type(answer).__name__} "
            f"{answer!r}; pass the function itself, without calling it"
        )
    return answer


def require_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ExerciseFailed(
            f"{what} returned {type(value).__name__} {value!r}; return an int (counts are whole "
            "numbers: use // instead of /, and int(...) on tensors)"
        )
    return int(value)
