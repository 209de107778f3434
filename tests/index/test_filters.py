"""FilterColumns: each column is parsed from the rows once, by the first filter that needs it."""

import numpy as np

from paraseek.index.filters import FilterColumns, SearchFilter


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
