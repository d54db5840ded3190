"""Two files that one process writes through HDF5, each made twice in DIR: once small enough for its quota, once too
large, with no check of the room before (as where the quota filled after one, or the file system cannot set room
aside). Prints the second's error, checks the first is whole, and ends normally.

usage: past_quota.py KIND DIR      (KIND: shard, a level-1 checkpoint shard; catalogue, circuits added to one)

Before, HDF5 met the quota inside the file's write, raised from its close, and the process crashed at its end
(SIGSEGV), the temporary file left.
"""

import hashlib
import sys
from pathlib import Path

import numpy as np

from mpiscale.circuits.store import ModelRef, NewCircuits, add_circuits
from mpiscale.io.checkpoint.files import read_shard, write_shard

KIND, DIRECTORY = sys.argv[1], Path(sys.argv[2])
FITS, TOO_LARGE = 1 << 17, 1 << 20  # a shard of 1 MiB, 8 MiB; a catalogue of 0.5 MiB, and 4 MiB more


def write(values: int) -> Path:
    """The file of KIND holding ``values`` numbers."""
    if KIND == "shard":
        path = DIRECTORY / "shard.h5"
        write_shard(path, 1, 0, 1, {"x": np.arange(values, dtype=np.float64)})
        return path
    path = DIRECTORY / "catalogue.h5"
    model = Path(DIRECTORY.parent / "module.pt2")
    model.write_bytes(b"a module's bytes")
    count = values // 1024
    atoms = np.random.default_rng(values).standard_normal((count, 512)).astype(np.float32)
    names = [f"{values}/{j}" for j in range(count)]
    add_circuits(str(path), NewCircuits(ModelRef.of(str(model), "export", 512, "float32"), "", names, atoms, "test"))
    return path


first = write(FITS)
before = hashlib.sha256(first.read_bytes()).hexdigest()
try:
    write(TOO_LARGE)
except OSError as error:
    print(f"refused: {error}")
else:
    print("the second file was written past the quota")
assert hashlib.sha256(first.read_bytes()).hexdigest() == before, "the first file changed"
if KIND == "shard":
    assert (read_shard(str(first), ["x"])["x"] == np.arange(FITS)).all()
print("left:", " ".join(sorted(path.name for path in DIRECTORY.iterdir())))
