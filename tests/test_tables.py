"""labkit.tables: the one HTML table every _repr_html_ builds."""

import pytest

from labkit.hardware.doctor.report import Check, Report
from labkit.tables import Html, html_table


def test_a_table_is_a_head_row_and_one_body_row_per_item():
    page = html_table(["what", "median"], [["matmul", "1.2 ms"], ["add", "3 us"]])
    assert page == (
        "<table><thead><tr><th>what</th><th>median</th></tr></thead><tbody>"
        "<tr><td>matmul</td><td>1.2 ms</td></tr><tr><td>add</td><td>3 us</td></tr>"
        "</tbody></table>"
    )


def test_every_cell_and_header_is_escaped():
    page = html_table(["<b>", "a&b"], [["<script>alert('x')</script>", '"q"']])
    assert "<script>" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "<th>a&amp;b</th>" in page and "<td>&quot;q&quot;</td>" in page


def test_numbers_and_none_render_as_their_text():
    page = html_table(["rank", "loss", "peak"], [[0, 2.5, None]])
    assert "<td>0</td><td>2.5</td><td>None</td>" in page


def test_html_cells_are_inserted_as_they_are():
    page = html_table(["detail"], [[Html("text<br><i>fix</i>")]])
    assert "<td>text<br><i>fix</i></td>" in page


def test_an_empty_body_keeps_the_head():
    page = html_table(("a", "b"), iter([]))
    assert page == "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody></tbody></table>"


def test_column_styles_and_row_classes():
    page = html_table(["", "found"], [["x", "y"]], styles=[None, "text-align:left"],
                      row_classes=["labkit-doctor-ok"])  # fmt: skip
    assert "<th></th><th style='text-align:left'>found</th>" in page
    assert "<tr class='labkit-doctor-ok'><td>x</td><td style='text-align:left'>y</td></tr>" in page


def test_a_row_or_styles_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="styles has 1 entries for 2 columns"):
        html_table(["a", "b"], [], styles=["x"])
    with pytest.raises(ValueError):
        html_table(["a", "b"], [["only one"]])


def test_the_doctor_escapes_what_a_check_found_but_keeps_its_fix_markup():
    check = Check(name="<item>", verdict="fail", detail="a < b", fix="run <this>")
    page = Report(checks=[check])._repr_html_()
    assert "<tr class='labkit-doctor-fail'>" in page and "&lt;item&gt;" in page
    assert "a &lt; b<br><i>fix: run &lt;this&gt;</i>" in page
