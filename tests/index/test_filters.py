"""FilterColumns: each column is parsed from the rows once, by the first filter that needs it."""

import numpy as np
import pytest

from paraseek.index.filters import FILTERED_EF_MAX, FilterColumns, SearchFilter, widened_ef, widened_nprobe

pytestmark = pytest.mark.quick


class CountingRows:
    def __init__(self, rows):
        self._rows, self.full_reads = rows, 0

    def __len__(self):
        return len(self._rows)

    def rows(self, begin=0, end=None):
        self.full_reads += 1
        return iter(self._rows[begin:end])

    def rows_at(self, numbers):
        return [self._rows[i] for i in numbers]


def test_columns_are_parsed_on_first_need_only():
    rows = [{"license": {"id": i % 3}, "captions": [f"photo {i}"]} for i in range(30)]
    source = CountingRows(rows)
    columns = FilterColumns(np.arange(100, 130), source, [])
    assert np.flatnonzero(columns.mask(SearchFilter(id_range={"lt": 110}))).tolist() == list(range(10))
    assert source.full_reads == 0  # ids are in memory: an id-range filter parses no row
    assert np.flatnonzero(columns.mask(SearchFilter(licence=[2], id_range={"gte": 120}))).tolist() == [20, 23, 26, 29]
    assert source.full_reads == 1
    columns.mask(SearchFilter(licence=[0]))
    assert source.full_reads == 1  # the licence column is kept
    assert np.flatnonzero(columns.mask(SearchFilter(caption_contains="PHOTO 1"))).tolist() == [1] + list(range(10, 20))
    assert source.full_reads == 2


def test_a_filter_widens_the_search_by_the_share_it_keeps():
    assert widened_nprobe(32, 4000, 0.1) == 320
    assert widened_nprobe(32, 100, 0.01) == 100  # every list, no more
    assert widened_nprobe(64, 32, 0.5) == 64  # never fewer lists than tuned
    assert widened_nprobe(32, 4000, 1.0) == widened_nprobe(32, 4000, 0.0) == 32  # everything or nothing matches
    assert widened_ef(128, 0.5) == 256
    assert widened_ef(128, 0.01) == FILTERED_EF_MAX
    assert widened_ef(2048, 0.1) == 2048  # never narrower than tuned
    assert widened_ef(128, 0.0) == 128
