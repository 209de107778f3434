"""The paraseek-vs-infinity comparison's own logic (the comparison itself is run by hand)."""

import pytest

from paraseek.loadtests.research.compare_infinity import one_pass, summarize, unique_captions


pytestmark = pytest.mark.quick


def _row(server, precision, rnd, c1_p50, rps8, rps32, p99=10.0):
    level = lambda rps: {"n": 100, "failures": 0, "rps": rps, "p50_ms": 5.0, "p99_ms": p99}  # noqa: E731
    return {"round": rnd, "server": server, "precision": precision,
            "c1": {**level(100.0), "p50_ms": c1_p50}, "c8": level(rps8), "c32": level(rps32)}


def test_summary_takes_medians_over_rounds_and_ratios_per_precision():
    rows = [_row("paraseek", "int8", r, c1, r8, r32) for r, (c1, r8, r32) in enumerate([(2, 800, 900), (1, 900, 1000), (3, 10, 950)])]
    rows += [_row("infinity", "int8", r, 6, 600, 800, p99=20.0) for r in range(3)]
    summary = summarize(rows)
    assert summary["medians"]["paraseek/int8"]["c8_rps"] == 800  # the outlier round does not move the median
    assert summary["medians"]["paraseek/int8"]["c1_p50_ms"] == 2
    ratios = summary["ratios"]["int8"]
    assert ratios["c8_rps"] == pytest.approx(800 / 600) and ratios["c32_rps"] == pytest.approx(950 / 800)
    assert ratios["c1_p50 (infinity/paraseek)"] == pytest.approx(3.0)
    assert ratios["c32_p99 (infinity/paraseek)"] == pytest.approx(2.0)
    assert "fp32" not in summary["ratios"]  # only precisions both servers ran


def test_captions_are_distinct_and_a_pass_never_repeats_one(shared_data):
    captions = unique_captions(shared_data)
    assert len(captions) > 19_000 and len(set(captions)) == len(captions)
    texts = one_pass(captions[:3])
    assert [next(texts) for _ in range(3)] == captions[:3]
    with pytest.raises(RuntimeError, match="ran out of unique captions"):
        next(texts)
