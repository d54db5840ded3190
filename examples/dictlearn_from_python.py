"""Dictionary learning from Python: learn atoms of handwritten digits, then code digits the dictionary never saw.

    python examples/dictlearn_from_python.py                                # in one process
    launch/mpiscale-run -n 2 -- python examples/dictlearn_from_python.py   # each rank passes its share of rows

Under a launcher each rank passes only its own rows and every rank ends with the same dictionary: the one the
single process learns (to rounding), so the numbers printed do not depend on the number of ranks.
"""

import numpy as np
from mpi4py import MPI
from sklearn.datasets import load_digits

from mpiscale.dictlearn import DictionaryLearning
from mpiscale.ranks import rank_rows

comm = MPI.COMM_WORLD
digits = load_digits().data  # 1,797 images of 8x8 pixels, values 0-16
digits = (digits - digits.mean(axis=1, keepdims=True)) / 16  # each image's mean removed: the atoms learn strokes
train, held_out = digits[:1500], digits[1500:]
start, stop = rank_rows(len(train), comm.Get_size(), comm.Get_rank())

estimator = DictionaryLearning(n_components=48, n_nonzero_coefs=5, batch_size=128, n_iter=300, random_state=0)
estimator.fit(train[start:stop])  # every rank its own block; the ranks sum their statistics each iteration

codes = estimator.transform(held_out)  # coding needs no other rank
rebuilt = estimator.inverse_transform(codes)
error = np.linalg.norm(held_out - rebuilt) / np.linalg.norm(held_out)
if comm.Get_rank() == 0:
    ranks = "1 rank" if comm.Get_size() == 1 else f"{comm.Get_size()} ranks"
    print(f"learned {estimator.n_components} atoms from {len(train):,} digits on {ranks} in {estimator.n_iter_} "
          "iterations")  # fmt: skip
    print(f"{len(held_out)} unseen digits, {estimator.n_nonzero_coefs} atoms each: relative error {error:.4f}")
