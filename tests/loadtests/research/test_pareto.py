"""loadtests/research/pareto.py: reading the tables of record and the front."""

import pytest

from paraseek.loadtests.research.pareto import Point, main, pareto_front, read_points

pytestmark = pytest.mark.quick


TABLES = """# a results file

| run | what changed | WiSE-FT α | AO@10 | T2I R@1 | STS ρ |
|---|---|---|---|---|---|
| base | – | 1.0 | 0.700 | 27.0 | 0.870 |
| strong | anchor w 5 | 0.8 | 0.760 | 26.0 | 0.850 |
| weak | nothing | 0.8 | 0.690 | 26.5 | 0.860 |

text between tables

| model | AO@10 | T2I R@1 | STS Spearman |
|---|---|---|---|
| robust + bank30 | **0.868** | 23.8 | 0.840 |
| no numbers | – | – | – |
"""


def test_reads_every_table_with_the_columns_and_finds_the_front(tmp_path):
    (tmp_path / "r.md").write_text(TABLES)
    points = read_points(tmp_path / "r.md")
    assert [p.label for p in points] == ["base α1.0", "strong α0.8 (anchor w 5)", "weak α0.8 (nothing)", "robust + bank30"]
    assert points[3].ao == 0.868 and points[3].sts == 0.840
    front = pareto_front(points)
    assert [p.label for p in front] == ["base α1.0", "strong α0.8 (anchor w 5)", "robust + bank30"]  # weak is dominated by base


def test_a_point_without_sts_is_compared_on_ao_and_r1():
    a, b = Point("a", 0.8, 27.0, None, "x"), Point("b", 0.7, 26.0, 0.9, "x")
    assert b.dominated_by(a) and not a.dominated_by(b)


def test_main_writes_the_table_and_the_plot(tmp_path, capsys):
    (tmp_path / "r.md").write_text(TABLES)
    (tmp_path / "again.md").write_text(TABLES)  # a row repeated in another file counts once
    assert main([str(tmp_path / "r.md"), str(tmp_path / "again.md"), "--out", str(tmp_path / "front")]) == 0
    table = (tmp_path / "front.md").read_text()
    assert table.count("| yes |") == 3 and table.count("\n") == 6
    assert (tmp_path / "front.png").stat().st_size > 10_000
