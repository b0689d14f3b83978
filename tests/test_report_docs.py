"""A documented table block may name a later table of its file (`path#n`), as README.md's GPU prediction does with
`make gpu-check`'s record, which holds several tables; the rest of the syncing is tested in test_report.py."""
from __future__ import annotations

import pytest

from specbench.bench.report.docs import doc_files, sync_docs

RECORD = ("# a record\n\n| path | ms |\n|---|---|\n| bare | 4.29 |\n\nbetween\n\n"
          "| drafter | τ | predicted |\n|---|---|---|\n| eagle2 | 4.34 | 2.16x |\n| pld | 1.75 | 1.22x |\n\n"
          "| last | x |\n|---|---|\n| y | 1 |\n")


def test_a_block_reads_the_nth_table_of_its_file(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.md").write_text(RECORD)
    doc = tmp_path / "README.md"
    doc.write_text("<!-- table: results/r.md#2 columns: * -->\nhand-typed\n<!-- end table -->\n"
                   "<!-- table: results/r.md#2 columns: drafter, predicted -->\n<!-- end table -->\n"
                   "<!-- table: results/r.md#3 -->\n<!-- end table -->\n")
    changed, missing = sync_docs(tmp_path, doc_files(tmp_path))
    assert changed == [doc] and missing == []
    assert doc.read_text() == (
        "<!-- table: results/r.md#2 columns: * -->\n| drafter | τ | predicted |\n|---|---|---|\n"
        "| eagle2 | 4.34 | 2.16x |\n| pld | 1.75 | 1.22x |\n<!-- end table -->\n"
        "<!-- table: results/r.md#2 columns: drafter, predicted -->\n| drafter | predicted |\n| --- | --- |\n"
        "| eagle2 | 2.16x |\n| pld | 1.22x |\n<!-- end table -->\n"
        "<!-- table: results/r.md#3 -->\n| last | x |\n|---|---|\n| y | 1 |\n<!-- end table -->\n")
    assert sync_docs(tmp_path, doc_files(tmp_path))[0] == []


def test_a_table_the_file_does_not_have_is_one_clear_error(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.md").write_text(RECORD)
    (tmp_path / "README.md").write_text("<!-- table: results/r.md#4 columns: * -->\n<!-- end table -->\n")
    with pytest.raises(ValueError, match="no table 4 \\(the file has 3\\)"):
        sync_docs(tmp_path, doc_files(tmp_path))
