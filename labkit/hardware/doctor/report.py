"""The doctor's results: the four verdicts, one item's ``Check``, and the ``Report`` of them all
as an aligned table, HTML (in a notebook) or JSON.

Apart from the checks (:mod:`labkit.hardware.doctor.gpu`, :mod:`labkit.hardware.doctor.host`)
because it is presentation: a check decides a verdict from facts, this module only holds and
shows it. It imports nothing from labkit.

    ok       works as the course expects
    info     not applicable on this tier, or plain information
    warning  works, but something will be slower, missing or differ from the tested setup
    fail     a lab will break; the check says what to do about it
"""

from __future__ import annotations

import dataclasses
import html
import json
from dataclasses import dataclass, field
from typing import Any

from labkit.tables import Html, html_table

VERDICTS = ("ok", "info", "warning", "fail")
SYMBOLS = {"ok": "✓", "info": "i", "warning": "!", "fail": "✗"}
ASCII_SYMBOLS = {"ok": "+", "info": "i", "warning": "!", "fail": "x"}  # for a non-UTF-8 terminal


@dataclass(frozen=True)
class Check:
    """One item of the report.

    Attributes:
        name: the item, e.g. "torch" or "all-reduce" (see ``ITEMS``).
        verdict: one of ``VERDICTS``.
        detail: what was found, in words (may span lines).
        fix: what to do; required for "warning" and "fail".
        data: the same facts as numbers and strings, for ``--json`` (units in the key names).
    """

    name: str
    verdict: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict={self.verdict!r} is not allowed: one of {VERDICTS}")
        if self.verdict in ("warning", "fail") and not self.fix.strip():
            raise ValueError(f"check {self.name!r}: a {self.verdict} needs a fix saying what to do")


@dataclass
class Report:
    """The checks, in order. ``exit_code`` is 1 when any item failed."""

    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.verdict == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def __getitem__(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; the report has {[c.name for c in self.checks]}")

    def counts(self) -> dict[str, int]:
        return {v: sum(c.verdict == v for c in self.checks) for v in VERDICTS}

    def summary(self) -> str:
        n = self.counts()
        head = f"{n['ok']} ok, {n['info']} info, {n['warning']} warning(s), {n['fail']} failure(s)"
        verdict = (
            "ready for the course"
            if self.ok
            else "not ready: fix the items marked fail, then run `python -m labkit doctor` again"
        )
        return f"{head}: {verdict}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def format(self, *, ascii_only: bool = False) -> str:
        """An aligned table: symbol, item, detail, and the fix under it."""
        symbols = ASCII_SYMBOLS if ascii_only else SYMBOLS
        width = max((len(c.name) for c in self.checks), default=0)
        pad = " " * (width + 6)  # under the detail column
        lines = ["labkit doctor"]
        for c in self.checks:
            detail = c.detail.splitlines() or [""]
            lines.append(f" {symbols[c.verdict]}  {c.name.ljust(width)}  {detail[0]}")
            lines += [pad + s for s in detail[1:]]
            if c.fix and c.verdict != "ok":
                lines.append(f"{pad}fix: {c.fix}")
        lines.append(self.summary())
        text = "\n".join(lines)
        if ascii_only:
            text = text.encode("ascii", "replace").decode("ascii")
        return text

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return self.format()

    def _repr_html_(self) -> str:
        colour = {"ok": "#1a7f37", "info": "#57606a", "warning": "#9a6700", "fail": "#cf222e"}
        esc = html.escape
        rows = []
        for c in self.checks:
            fix = f"<br><i>fix: {esc(c.fix)}</i>" if c.fix and c.verdict != "ok" else ""
            symbol = f"<span style='color:{colour[c.verdict]}' title='{c.verdict}'>"
            rows.append([Html(f"{symbol}{SYMBOLS[c.verdict]}</span>"), c.name,
                         Html(f"{esc(c.detail)}{fix}")])  # fmt: skip
        # JupyterLab centres cells and right-aligns them: the free text reads top-left instead.
        top = "vertical-align:top"
        styles = [f"font-weight:bold;{top}", f"white-space:nowrap;{top}",
                  f"text-align:left;white-space:pre-wrap;{top}"]  # fmt: skip
        table = html_table(["", "item", "found"], rows, styles=styles,
                           row_classes=[f"labkit-doctor-{c.verdict}" for c in self.checks])  # fmt: skip
        return f"<div class='labkit-doctor'>{table}<p><b>{esc(self.summary())}</b></p></div>"


# What a check returns; the runner (labkit.hardware.doctor) fills in the item's name.


def ok(detail: str, **data: Any) -> Check:
    return Check("", "ok", detail, "", data)


def info(detail: str, fix: str = "", **data: Any) -> Check:
    return Check("", "info", detail, fix, data)


def warning(detail: str, fix: str, **data: Any) -> Check:
    return Check("", "warning", detail, fix, data)


def fail(detail: str, fix: str, **data: Any) -> Check:
    return Check("", "fail", detail, fix, data)


def first_line(err: BaseException) -> str:
    """An error's first line (a job's error carries its traceback below), or its class name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
