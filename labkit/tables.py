"""The one HTML table every ``_repr_html_`` in labkit builds.

A result renders in a notebook as a header row and body rows; each cell is escaped here, once,
so no caller can forget to. It is a foundation (it imports nothing from labkit) because results
on every layer, from ``timing`` to ``jobs.outcome``, draw their tables with it.

JupyterLab's stylesheet right-aligns every table cell and centres it vertically; a column that
needs otherwise (the doctor's free text) passes its own CSS in ``styles``.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

__all__ = ["Html", "html_table"]


class Html(str):
    """A cell that is already HTML (markup the caller built and escaped): inserted as is.

    Like ``markupsafe.Markup``, it says so through ``__html__``; any object with that method is
    trusted the same way.
    """

    def __html__(self) -> str:
        return str(self)


def html_table(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    styles: Sequence[str | None] | None = None,
    row_classes: Sequence[str] | None = None,
) -> str:
    """``<table>`` with ``header`` as its head row and one body row per item of ``rows``.

    Each cell is ``str(cell)``, escaped with :func:`html.escape`, unless it has ``__html__``
    (:class:`Html`). ``styles`` holds one CSS declaration (or None) per column, set on that
    column's header and body cells; ``row_classes`` one class per body row.
    """
    if styles is not None and len(styles) != len(header):
        raise ValueError(f"styles has {len(styles)} entries for {len(header)} columns")
    attrs = [f" style='{html.escape(s)}'" if s else "" for s in styles or [None] * len(header)]
    head = "".join(f"<th{a}>{_cell(h)}</th>" for a, h in zip(attrs, header, strict=True))
    body = []
    for i, row in enumerate(rows):
        tr = "<tr>" if row_classes is None else f"<tr class='{html.escape(row_classes[i])}'>"
        cells = "".join(f"<td{a}>{_cell(c)}</td>" for a, c in zip(attrs, row, strict=True))
        body.append(f"{tr}{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _cell(value: object) -> str:
    markup = getattr(value, "__html__", None)
    return markup() if callable(markup) else html.escape(str(value))
