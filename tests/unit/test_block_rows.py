"""How rows are divided among ranks (reduce_scatter, benchmark shares)."""

import numpy as np
import pytest

from mpiscale.runtime.collectives import block_rows


@pytest.mark.parametrize("total, parts", [(0, 3), (2, 4), (9, 4), (10, 5), (1001, 7)])
def test_block_rows_splits_like_numpy(total, parts):
    assert block_rows(total, parts) == [len(b) for b in np.array_split(np.empty(total), parts)]
