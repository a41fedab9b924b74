"""Rows of an index file read by position (RowFile) against slicing the same file's memory map."""
import numpy as np
import pytest

from pyserini_aligner.index.format import IndexFormatError
from pyserini_aligner.index.reader import RowFile, memmap


@pytest.mark.parametrize("dtype, shape", [(np.uint16, ()), (np.uint8, (5,)), (np.int32, (3,))])
def test_ranges_are_the_rows_of_the_runs_in_order(tmp_path, dtype, shape):
    """Runs in any order, empty runs, adjacent runs (read at once) and a run to the last row: the rows the map
    slices give, one run after the other."""
    rows = 97
    data = np.random.default_rng(0).integers(0, 200, (rows, *shape)).astype(dtype)
    path = tmp_path / "rows.bin"
    data.tofile(path)
    mapped = memmap(path, dtype, (rows, *shape))
    file = RowFile(path, dtype, shape)
    for starts, counts in [([0], [rows]), ([3, 10, 13, 40], [7, 3, 0, 57]), ([50, 0, 5, 6], [2, 5, 1, 4]),
                           ([96, 96], [1, 0]), ([], [])]:
        got = file.ranges(np.array(starts, np.int64), np.array(counts, np.int64))
        want = np.concatenate([mapped[s:s + c] for s, c in zip(starts, counts)] or [mapped[:0]])
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


def test_a_run_past_the_end_of_a_truncated_file_names_it(tmp_path):
    path = tmp_path / "codes.bin"
    np.arange(40, dtype=np.uint8).tofile(path)
    with pytest.raises(IndexFormatError, match="codes.bin: shorter than its rows"):
        RowFile(path, np.uint8, (4,)).ranges(np.array([8]), np.array([3]))


def test_rows_stay_readable_after_the_file_is_removed(tmp_path):
    """A live update may remove the files of a generation that a reader still searches: as through a memory map,
    the rows stay readable while the RowFile lives."""
    path = tmp_path / "ids.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    file = RowFile(path, np.uint16)
    path.unlink()
    assert file.ranges(np.array([2]), np.array([3])).tolist() == [2, 3, 4]
