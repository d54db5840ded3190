"""One iteration's statistics (a single flat buffer, summed over the ranks) and the dictionary updates.

Every rank fills its part of a ``BatchStatistics`` buffer from its slice of the
batch, one allreduce sums the buffers, and every rank then applies the same
update to the same numbers, so the dictionaries stay identical without ever
being sent. The buffer also carries each rank's worst-coded signals (in that
rank's own slot, zeros elsewhere), so choosing replacement atoms costs no extra
collective and picks the same signals whatever the number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..kernels.code_statistics import accumulate_statistics, fold_packed
from ..kernels.dict_update import block_coordinate_update, near_duplicates
from .coding import CodeRows

_UNUSED_WEIGHT = 1e-12  # A_jj at or below this times the largest A_ii: the atom took no part


def least_weight(a: np.ndarray) -> float:
    """The weight ``A_jj`` at or below which an atom took no part: relative to the most used atom's, so the same
    atoms move at any scale of the data (an absolute 1e-12 froze every atom of data at 1e-6)."""
    return _UNUSED_WEIGHT * float(np.diagonal(a).max()) if len(a) else 0.0


class BatchStatistics:
    """Views into one float64 buffer: A (its upper triangle), B, atom usage, sums, and replacement candidates.

    A is symmetric, so only its upper triangle travels: for 256 atoms of 64
    values that makes the buffer 40% smaller. ``unpack`` rebuilds the full ``a``
    after the allreduce.
    """

    SUMS = ("signals", "energy", "residual", "nonzeros", "l1")
    a_upper: np.ndarray
    b: np.ndarray
    usage: np.ndarray
    sums: np.ndarray
    candidates: np.ndarray

    def __init__(self, atoms: int, features: int, ranks: int, candidates: int) -> None:
        self.a = np.zeros((atoms, atoms))
        shapes = {
            "a_upper": (atoms * (atoms + 1) // 2,),
            "b": (atoms, features),
            "usage": (atoms,),
            "sums": (len(self.SUMS),),
            "candidates": (ranks, candidates, features + 2),  # (residual energy, sample id, residual)
        }
        self.buffer = np.zeros(sum(int(np.prod(s)) for s in shapes.values()))
        offset = 0
        for name, shape in shapes.items():
            count = int(np.prod(shape))
            setattr(self, name, self.buffer[offset : offset + count].reshape(shape))
            offset += count

    def fill(
        self, rank: int, ids: np.ndarray, signals: np.ndarray, codes: CodeRows, dictionary: np.ndarray, alpha: float
    ) -> None:
        """This rank's contribution from its signals and their codes (kept sparse, as the coders give them)."""
        self.buffer[:] = 0.0
        residual = np.empty_like(signals)
        accumulate_statistics(codes.values, codes.atoms, codes.counts, signals, dictionary, self.a_upper, self.b,
                              self.usage, residual)  # fmt: skip
        energy = np.einsum("sf,sf->s", residual, residual)
        self.sums[:] = (len(signals), np.einsum("sf,sf->", signals, signals), energy.sum(), self.usage.sum(), 0.0)
        if alpha:
            self.sums[4] = codes.l1()
        worst = np.lexsort((ids, -energy))[: self.candidates.shape[1]]
        slot = self.candidates[rank]
        slot[:, 0] = -1.0  # empty slots lose to any real signal
        slot[: len(worst), 0] = energy[worst]
        slot[: len(worst), 1] = ids[worst]
        slot[: len(worst), 2:] = residual[worst]

    def unpack(self) -> None:
        """The full, exactly symmetric ``a`` from the (summed) upper triangle in the buffer."""
        fold_packed(self.a, self.a_upper, 0.0, 1.0)

    def sum(self, name: str) -> float:
        """One of the summed scalars ``SUMS``."""
        return float(self.sums[self.SUMS.index(name)])

    def metrics(self, alpha: float) -> dict[str, float]:
        """The batch's objective, relative error, mean non-zeros per code and unused atoms."""
        signals = max(self.sum("signals"), 1.0)
        energy = self.sum("energy")
        return {
            "objective": (0.5 * self.sum("residual") + alpha * self.sum("l1")) / signals,
            "error": math.sqrt(self.sum("residual") / energy) if energy > 0 else 0.0,
            "sparsity": self.sum("nonzeros") / signals,
            "unused": float(np.count_nonzero(self.usage == 0)),
        }

    def worst_signals(self) -> np.ndarray:
        """Residuals of the batch's ``candidates`` worst-coded signals, worst first (ties: lower sample id first).

        Each rank offers its own worst; the batch's worst are among them, so the
        choice (and how many atoms an iteration replaces) is the same on any number of ranks.
        """
        limit = self.candidates.shape[1]
        rows = self.candidates.reshape(-1, self.candidates.shape[2])
        rows = rows[rows[:, 0] > 0]
        order = np.lexsort((rows[:, 1], -rows[:, 0]))[:limit]
        return rows[order, 2:]


@dataclass
class DictionaryState:
    """What the learner carries from one iteration to the next (and checkpoints)."""

    dictionary: np.ndarray  # atoms x features, unit rows
    a: np.ndarray  # atoms x atoms, the (decayed) sum of c c^T
    b: np.ndarray  # atoms x features, the (decayed) sum of c x^T
    idle: np.ndarray  # atoms: consecutive batches in which each atom was not used

    @classmethod
    def start(cls, dictionary: np.ndarray) -> DictionaryState:
        atoms, features = dictionary.shape
        return cls(dictionary, np.zeros((atoms, atoms)), np.zeros((atoms, features)), np.zeros(atoms, np.int64))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The state, for checkpoints (``jobs.Stateful``)."""
        return {"dictionary": self.dictionary, "a": self.a, "b": self.b, "idle": self.idle}

    def from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The state ``to_arrays`` gave, for a dictionary of the same shape."""
        atoms, features = self.dictionary.shape
        shapes = {"dictionary": (atoms, features), "a": (atoms, atoms), "b": (atoms, features), "idle": (atoms,)}
        for name, shape in shapes.items():
            if arrays[name].shape != shape:
                raise ValueError(f"the saved {name} is of shape {arrays[name].shape}, the job needs {shape}")
        self.dictionary, self.a, self.b, self.idle = (np.array(arrays[name]) for name in shapes)


def forgetting_factor(iteration: int, rate: float) -> float:
    """Weight ``(1 - 1/t)^rate`` of the past statistics at (0-based) ``iteration`` (Mairal et al., 2010, 3.4).

    The statistics then remember about the last ``t / rate`` batches: early
    codes, made with a poor dictionary, fade out quickly.
    """
    return (1.0 - 1.0 / (iteration + 1)) ** rate


def online_update(state: DictionaryState, stats: BatchStatistics, iteration: int, rate: float) -> None:
    """Fold the batch into the decayed statistics, then one block-coordinate sweep over the atoms."""
    beta = forgetting_factor(iteration, rate)
    signals = max(stats.sum("signals"), 1.0)
    fold_packed(state.a, stats.a_upper, beta, signals)  # straight from the packed sum: no unpacked copy
    state.b *= beta
    state.b += stats.b / signals
    block_coordinate_update(state.dictionary, state.a, state.b, least_weight(state.a))


def mod_update(state: DictionaryState, stats: BatchStatistics) -> None:
    """Method of optimal directions: D = (C^T C)^-1 C^T X on the whole data set, atoms rescaled to unit norm."""
    stats.unpack()
    state.a[:] = stats.a
    state.b[:] = stats.b
    used = np.diag(stats.a) > least_weight(stats.a)
    if not used.any():
        return
    a = stats.a[np.ix_(used, used)]
    ridge = 1e-10 * max(np.trace(a) / len(a), 1e-300)
    solved = np.linalg.solve(a + ridge * np.eye(len(a)), stats.b[used])
    norms = np.linalg.norm(solved, axis=1, keepdims=True)
    keep = norms[:, 0] > 0
    rows = np.flatnonzero(used)[keep]
    state.dictionary[rows] = solved[keep] / norms[keep]


def atoms_to_replace(
    state: DictionaryState, usage: np.ndarray, replace_after: int, duplicate_cosine: float, gram: np.ndarray
) -> list:
    """Atoms idle for ``replace_after`` batches, and the less used of each near-duplicate pair.

    ``gram`` is ``D D^T`` of the current dictionary (the coder of the next batch needs it too).
    """
    state.idle[:] = np.where(usage == 0, state.idle + 1, 0)
    chosen = set(np.flatnonzero(state.idle >= replace_after).tolist())
    if duplicate_cosine < 1:
        weight = np.diag(state.a)
        for i, j in near_duplicates(gram, duplicate_cosine).tolist():
            if i not in chosen and j not in chosen:
                chosen.add(j if weight[j] <= weight[i] else i)
    return sorted(chosen)


def close_pairs(dictionary: np.ndarray, threshold: float) -> tuple[int, float]:
    """How many pairs of atoms have a |cosine| above ``threshold``, and the largest |cosine| between two atoms."""
    gram = dictionary @ dictionary.T
    np.fill_diagonal(gram, 0.0)
    return len(near_duplicates(gram, threshold)), float(np.abs(gram).max()) if len(gram) > 1 else 0.0


def replace_atoms(state: DictionaryState, atoms: list, residuals: np.ndarray) -> int:
    """Point atoms at the worst-coded residuals (one each, in order); forget their statistics. Returns how many."""
    count = 0
    for atom, residual in zip(atoms, residuals):
        norm = np.linalg.norm(residual)
        if norm <= 0:
            break
        state.dictionary[atom] = residual / norm
        state.a[atom, :] = 0.0
        state.a[:, atom] = 0.0
        state.b[atom] = 0.0
        state.idle[atom] = 0
        count += 1
    return count
