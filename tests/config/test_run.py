"""config/run.py: the chunk plan counts the per-row working set, so short rows stay within --max-memory."""

import pytest

from attncheck.config.run import (
    ROW_BYTES,
    ROW_BYTES_PER_CELL,
    WORKING_BYTES_PER_ELEMENT,
    Options,
    check_row_fits,
    chunk_elements_for,
    chunk_row_bytes,
    rows_per_chunk,
)
from attncheck.errors import AttncheckError

MiB = 1 << 20
PER_ROW_MEASURED = (
    1170  # bytes a 1-key row needed with the 12 default cells (peak RSS of 4M rows in one chunk, minus the interpreter)
)


@pytest.mark.parametrize("budget", [1 * MiB, 64 * MiB, 512 * MiB])
def test_one_key_rows_plan_within_the_budget(budget):
    options = Options(chunk_elements=chunk_elements_for(budget))
    rows = rows_per_chunk(1, options)
    assert rows * chunk_row_bytes(1, options) <= budget
    assert rows * PER_ROW_MEASURED <= budget  # what such rows were measured to need
    assert rows < budget // WORKING_BYTES_PER_ELEMENT // 10  # elements alone would allow 12x as many rows


def test_row_bytes_count_every_cell_and_the_row_constant():
    one = Options(dtypes=("fp32",), methods=("stable",))
    every = Options()
    assert chunk_row_bytes(1, one) == WORKING_BYTES_PER_ELEMENT + ROW_BYTES + ROW_BYTES_PER_CELL
    assert chunk_row_bytes(1, every) == WORKING_BYTES_PER_ELEMENT + ROW_BYTES + 12 * ROW_BYTES_PER_CELL
    assert chunk_row_bytes(1, every) >= PER_ROW_MEASURED


@pytest.mark.parametrize(
    "keys, block, width",
    [(129, 128, 256), (128, 128, 128), (100, 128, 100), (1000, 1, 1000), (1025, 512, 1536), (3, 2, 4)],
)
def test_tiled_pads_rows_to_whole_blocks(keys, block, width):
    tiled = Options(dtypes=("fp16",), methods=("tiled",), block=block)
    stable = Options(dtypes=("fp16",), methods=("stable",), block=block)
    assert chunk_row_bytes(keys, tiled) - chunk_row_bytes(keys, stable) == (width - keys) * WORKING_BYTES_PER_ELEMENT


@pytest.mark.parametrize("keys", [1, 7, 64, 129, 1024, 1 << 20])
def test_long_rows_keep_their_chunks_and_a_row_never_splits(keys):
    options = Options(chunk_elements=chunk_elements_for(64 * MiB))
    rows = rows_per_chunk(keys, options)
    assert rows >= 1 and (rows == 1 or rows * chunk_row_bytes(keys, options) <= 64 * MiB)
    if keys >= 1024:  # elements dominate: within a few percent of the element-only plan
        assert rows >= 0.9 * (options.chunk_elements // keys)


def test_a_row_longer_than_the_budget_is_refused_not_split():
    """A row is never split: one that alone passes the budget (a stride-0 row of 2e9 keys in a few
    bytes of .pt) is refused, naming the budget, rather than diagnosed beyond it."""
    check_row_fits("x", 699_050, 64 * MiB)
    with pytest.raises(
        AttncheckError, match=r"^x: a row of 1,048,576 keys needs 96 MiB of working memory, over max_memory 64 MiB"
    ):
        check_row_fits("x", 1 << 20, 64 * MiB)
