"""eval.measured: the README's Measured table is what the result files it cites hold."""

from __future__ import annotations

import pytest

from eval import measured


def test_the_readme_table_is_current():
    """Fails when a result file changed (or a row was edited by hand): run `python -m eval.measured`."""
    assert measured.main(["--check"]) == 0


def test_every_row_reads_its_figures_from_its_file():
    lines = measured.table().splitlines()
    assert lines[0] == measured.BEGIN and lines[-1] == measured.END and len(lines) == len(measured.ROWS) + 4
    for row, line in zip(measured.ROWS, lines[3:-1]):
        assert line.startswith(f"| {row.what} |") and "{" not in line  # every placeholder was filled


def test_a_changed_figure_makes_the_check_fail_and_the_rewrite_restores_it(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    current = measured.README.read_text(encoding="utf-8")
    readme.write_text(
        current.replace(
            "| drop-in `generate`, decode ms/step, B=4 x 32K | **",
            "| drop-in `generate`, decode ms/step, B=4 x 32K | **9",
            1,
        )
    )
    monkeypatch.setattr(measured, "README", readme)
    assert measured.main(["--check"]) == 1
    assert measured.main([]) == 0 and readme.read_text(encoding="utf-8") == current


def test_a_readme_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="no measured table markers"):
        measured.replaced("# a README without the table\n", measured.table())
