"""One iteration of the learner as every rank runs it: code this rank's signals into the batch's statistics, then,
once the caller has summed the statistics over the ranks, update the dictionary the same way on every rank.

The job (``learner``) and the estimator (``estimator``) both run their iterations through it, so both learn the
same dictionary from the same batches; only where the batches come from and how the sum is taken differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .coding import (
    CodeRows,
    correlations_of,
    gram_matrix,
    lasso_encode_gram,
    omp_rows_gram,
    rows_of_dense,
    squared_norms,
)
from .update import BatchStatistics, DictionaryState, atoms_to_replace, mod_update, online_update, replace_atoms


@dataclass(frozen=True)
class Rule:
    """How an iteration codes and updates: the settings of the job (or estimator) that an iteration uses."""

    method: str  # online or mod
    coder: str  # omp or lasso
    sparsity: int  # OMP: non-zeros per code
    alpha: float  # Lasso: the L1 penalty
    forgetting: float  # online: how fast past statistics fade
    replace_after: int  # batches an atom may go unused before it is replaced
    max_replace: int  # most atoms replaced in one iteration
    duplicate_cosine: float  # |cosine| above which one of two atoms is replaced
    max_residual: float = 0.0  # OMP: stop coding a signal once its residual norm is at most this (0: never)
    remove_mean: bool = False  # each signal's mean is subtracted before it is coded

    @property
    def penalty(self) -> float:
        """The L1 penalty in the objective: alpha for Lasso, none for OMP."""
        return self.alpha if self.coder == "lasso" else 0.0


class Iteration:
    """A rank's share of each iteration over one dictionary state: ``fill``, a sum over the ranks, ``apply``."""

    def __init__(self, rule: Rule, state: DictionaryState, ranks: int, device: str = "cpu") -> None:
        self.rule, self.state, self.device = rule, state, device
        atoms, features = state.dictionary.shape
        self.stats = BatchStatistics(atoms, features, ranks, rule.max_replace)
        self.gram = gram_matrix(state.dictionary)  # D D^T, kept for the coder and the duplicate check

    def prepared(self, signals: np.ndarray) -> np.ndarray:
        """The signals as the learner sees them: each one's mean removed when the rule says so."""
        return without_means(signals) if self.rule.remove_mean else signals

    def code(self, signals: np.ndarray) -> CodeRows:
        """Codes of prepared ``signals`` (rows) with the current dictionary, kept sparse."""
        correlations = correlations_of(signals, self.state.dictionary)
        rule = self.rule
        if rule.coder == "lasso":
            codes = lasso_encode_gram(self.gram, correlations, rule.alpha)
            return rows_of_dense(codes, int(np.count_nonzero(codes, axis=1).max(initial=0)))  # rows as wide as needed
        if rule.max_residual:
            return omp_rows_gram(self.gram, correlations, rule.sparsity, "cpu", rule.max_residual,
                                 squared_norms(signals))  # fmt: skip
        return omp_rows_gram(self.gram, correlations, rule.sparsity, self.device)

    def fill(self, rank: int, ids: np.ndarray, signals: np.ndarray) -> None:
        """This rank's part of the statistics (``stats.buffer``), from its signals and their global sample ids."""
        signals = self.prepared(signals)
        codes = self.code(signals)
        self.stats.fill(rank, ids, signals, codes, self.state.dictionary, self.rule.penalty)

    def apply(self, iteration: int) -> int:
        """The update from the summed ``stats.buffer`` at (0-based) ``iteration``; returns the atoms replaced."""
        state, rule = self.state, self.rule
        if rule.method == "online":
            online_update(state, self.stats, iteration, rule.forgetting)
        else:
            mod_update(state, self.stats)
        self.gram = gram_matrix(state.dictionary)
        replace = atoms_to_replace(state, self.stats.usage, rule.replace_after, rule.duplicate_cosine, self.gram)
        replaced = replace_atoms(state, replace, self.stats.worst_signals()) if replace else 0
        if replaced:
            self.gram = gram_matrix(state.dictionary)
        return replaced


def without_means(signals: np.ndarray) -> np.ndarray:
    """``signals`` (rows) each less its own mean: a copy."""
    return signals - signals.mean(axis=1, keepdims=True)
