"""Write token sequences of varying length the two ways users store them, for ``mpiscale train --offsets``.

    python examples/ragged_tokens.py tokens.h5
    launch/mpiscale-run -n 2 -- mpiscale train --model transformer --data tokens.h5 --inputs values \\
        --offsets starts --batching memory --batch-tokens 2000
    launch/mpiscale-run -n 2 -- mpiscale train --model transformer --data tokens.h5 --inputs sequences

Each sequence holds 4 to 48 tokens of a vocabulary of 16 and is labelled by whichever of the tokens 0-3 it holds
most often. The file holds them as ``values`` (every token, int32) with ``starts`` (where each sequence begins),
as ``sequences`` (an HDF5 variable-length data set of int16 rows, the same tokens) and ``labels`` (int8).
Plain h5py, one process: nothing here is mpiscale's.
"""

from __future__ import annotations

import argparse

import h5py
import numpy as np


def write(path: str, sequences: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 16, n) for n in rng.integers(4, 49, sequences)]
    labels = [int(np.bincount(row[row < 4], minlength=4).argmax()) for row in rows]
    with h5py.File(path, "w") as file:
        file["values"] = np.concatenate(rows).astype(np.int32)
        file["starts"] = np.cumsum([0] + [len(row) for row in rows[:-1]])
        ragged = file.create_dataset("sequences", (sequences,), dtype=h5py.vlen_dtype(np.int16))
        for index, row in enumerate(rows):
            ragged[index] = row
        file["labels"] = np.array(labels, dtype=np.int8)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="the HDF5 file to write")
    parser.add_argument("--sequences", type=int, default=4000, help="how many sequences (default: 4000)")
    options = parser.parse_args()
    written = write(options.path, options.sequences)
    print(f"wrote {options.path}: {len(written)} sequences of {min(map(len, written))}-{max(map(len, written))} tokens")
