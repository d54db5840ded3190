"""``DictionaryLearning``: the learner as a scikit-learn estimator (``fit``, ``partial_fit``, ``transform``).

In one process it learns from the rows it is given. Under ``mpirun``/``srun``
(or given ``comm``), each rank passes its own rows, the global data set is the
ranks' rows in rank order, and every rank ends with the same dictionary. The
iterations are the job's (``iteration``), over the same batches in the same
order (``io.epoch_plan``), so on the same data and settings the estimator and
``mpiscale dictlearn`` learn the same dictionary, on any number of ranks.

Differences from the job, where the job refuses: more atoms than signals start
from random directions beyond the signals, a batch larger than the data is the
data, and a code never holds more atoms than the signals have features.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
    from sklearn.utils.validation import check_array, check_is_fitted, check_random_state, validate_data
except ModuleNotFoundError as missing:  # an optional dependency: the jobs run without it
    raise ModuleNotFoundError(
        "mpiscale.dictlearn.DictionaryLearning is a scikit-learn estimator: pip install 'mpiscale[sklearn]'"
    ) from missing

from ..io import entered_by_all, epoch_plan, not_numbers
from ..kernels.threads import blas_beside_numba
from ..ranks import RANK_VARIABLES, AnyComm, Comm, agree, as_mpi
from ..srun_tasks import refuse_unjoinable_launch
from .coding import lasso_encode, omp_encode
from .config import CODERS, METHODS
from .data import initial_ids, scale_problem, unit_atoms
from .iteration import Iteration, Rule, without_means
from .results import load_results
from .update import DictionaryState

TRANSFORMS = ("omp", "lasso_cd")  # scikit-learn's names of the coders transform offers
_WHAT = "DictionaryLearning"


class DictionaryLearning(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """Sparse dictionary learning (online mini-batches, Mairal et al. 2009, or MOD), across MPI ranks.

    Parameters follow ``mpiscale dictlearn``'s options (``n_components`` is
    ``--atoms``, ``n_nonzero_coefs`` ``--sparsity``, ``fit_algorithm``
    ``--coder``, ``n_iter`` ``--iterations``, ``random_state`` ``--seed``;
    ``max_iter``, as scikit-learn's, counts passes over the data instead:
    given, ``fit`` runs that many epochs of mini-batches, and ``n_iter`` is
    not read;
    ``max_residual`` None is ``--max-residual 0``, no error target);
    ``transform_*`` choose how ``transform`` codes new data, as in
    scikit-learn's ``MiniBatchDictionaryLearning`` (``transform_max_residual``
    None takes ``max_residual``). ``comm``: an mpi4py
    communicator (or an ``ActorSystem``'s ``world``) whose ranks each pass
    their rows; by default the world when the process was started by an MPI
    launcher, else none.

    Fitted attributes: ``components_`` (atoms x features, unit rows),
    ``n_iter_`` (iterations run, ``partial_fit`` calls included),
    ``n_features_in_``, ``error_`` (the last batch's relative error).
    """

    def __init__(
        self,
        n_components: int = 50,
        *,
        n_nonzero_coefs: int = 3,
        alpha: float = 0.1,
        max_residual: float | None = None,
        remove_mean: bool = False,
        fit_algorithm: str = "omp",
        method: str = "online",
        batch_size: int = 256,
        n_iter: int = 400,
        max_iter: int | None = None,
        forgetting: float = 10.0,
        replace_after: int = 3,
        max_replace: int = 4,
        duplicate_cosine: float = 0.99,
        shuffle_window_mib: float = 64.0,
        transform_algorithm: str = "omp",
        transform_n_nonzero_coefs: int | None = None,
        transform_alpha: float | None = None,
        transform_max_residual: float | None = None,
        transform_max_iter: int = 1000,
        device: str = "cpu",
        random_state: Any = 0,
        comm: AnyComm | None = None,
    ) -> None:
        self.n_components = n_components
        self.n_nonzero_coefs = n_nonzero_coefs
        self.alpha = alpha
        self.max_residual = max_residual
        self.remove_mean = remove_mean
        self.fit_algorithm = fit_algorithm
        self.method = method
        self.batch_size = batch_size
        self.n_iter = n_iter
        self.max_iter = max_iter
        self.forgetting = forgetting
        self.replace_after = replace_after
        self.max_replace = max_replace
        self.duplicate_cosine = duplicate_cosine
        self.shuffle_window_mib = shuffle_window_mib
        self.transform_algorithm = transform_algorithm
        self.transform_n_nonzero_coefs = transform_n_nonzero_coefs
        self.transform_alpha = transform_alpha
        self.transform_max_residual = transform_max_residual
        self.transform_max_iter = transform_max_iter
        self.device = device
        self.random_state = random_state
        self.comm = comm

    @classmethod
    def from_results(cls, path: str, **params: Any) -> DictionaryLearning:
        """A fitted estimator holding the dictionary a ``mpiscale dictlearn`` job wrote to ``path``, with the job's
        settings (``params`` override them, e.g. ``transform_algorithm``). ``partial_fit`` goes on from the
        dictionary, with fresh statistics: the results file keeps the dictionary, not the job's running sums."""
        learned = load_results(path)
        config = learned.config
        settings: dict[str, Any] = dict(
            n_components=config.atoms, n_nonzero_coefs=config.sparsity, alpha=config.alpha, fit_algorithm=config.coder,
            method=config.method, batch_size=config.batch_size, n_iter=config.iterations, forgetting=config.forgetting,
            replace_after=config.replace_after, max_replace=config.max_replace,
            duplicate_cosine=config.duplicate_cosine, shuffle_window_mib=config.shuffle_window_mib,
            max_residual=config.max_residual or None, remove_mean=config.remove_mean,
            random_state=config.seed,
        )  # fmt: skip
        estimator = cls(**(settings | params))
        estimator._state = DictionaryState.start(learned.dictionary)
        estimator.components_ = estimator._state.dictionary
        estimator.n_features_in_ = learned.features
        estimator.n_iter_ = learned.iterations
        estimator.error_ = float(learned.metrics["error"][-1]) if learned.iterations else math.nan
        return estimator

    # ----------------------------------------------------------------- learning
    def fit(self, X: Any, y: Any = None) -> DictionaryLearning:
        """Learn a dictionary from ``X`` (signals x features; each rank its own rows); returns self."""
        comm = _resolve(self.comm)
        _together(comm, "fit")
        signals, seed = self._checked(comm, X, reset=True)
        data = _Rows(signals, comm)
        iteration = self._start(comm, data, seed)
        batch = min(self.batch_size, data.samples)
        steps = data.samples // batch  # the job's reader drops the last partial batch of an epoch
        per_pass = 1 if self.method == "mod" else steps  # (mod takes the whole data set each iteration)
        iterations = self.n_iter if self.max_iter is None else self.max_iter * per_pass
        window = max(max(1, int(self.shuffle_window_mib * 2**20) // (8 * data.features)), batch)
        plan_epoch, order = -1, np.empty(0, np.int64)
        for done in range(iterations):
            if self.method == "mod":
                ids = data.global_ids()
            else:
                epoch, step = divmod(done, steps)
                if epoch != plan_epoch:
                    plan_epoch, order = epoch, epoch_plan(data.samples, epoch, seed, True, window).order
                ids = order[step * batch : (step + 1) * batch]
            self._iterate(iteration, data, ids, done)
        return self

    def partial_fit(self, X: Any, y: Any = None) -> DictionaryLearning:
        """One online iteration with ``X`` as the mini-batch (each rank its part); the first call starts the
        dictionary from ``X``'s rows. Returns self."""
        comm = _resolve(self.comm)
        _together(comm, "partial_fit")
        first = not hasattr(self, "components_")
        signals, seed = self._checked(comm, X, reset=first)
        if self.method != "online":
            raise ValueError(f"partial_fit takes online steps: method is {self.method!r}, give method='online'")
        data = _Rows(signals, comm)
        if first:
            iteration, done = self._start(comm, data, seed), 0
        else:
            iteration, done = Iteration(self._rule(data.features), self._state, data.ranks, self.device), self.n_iter_
        self._iterate(iteration, data, data.global_ids(), done)
        return self

    def _iterate(self, iteration: Iteration, data: _Rows, ids: np.ndarray, done: int) -> None:
        """One iteration over the signals of the global ``ids`` this rank holds."""
        mine = data.mine(ids)
        with blas_beside_numba():
            iteration.fill(data.rank, mine, data.signals[mine - data.offset])
            if data.comm is not None:
                from mpi4py import MPI

                data.comm.Allreduce(MPI.IN_PLACE, iteration.stats.buffer, op=MPI.SUM)
            iteration.apply(done)
        self.components_ = iteration.state.dictionary
        self.n_iter_ = done + 1
        self.error_ = iteration.stats.metrics(iteration.rule.penalty)["error"]

    def _start(self, comm: Comm | None, data: _Rows, seed: int) -> Iteration:
        """The first atoms (the job's: distinct signals chosen by the seed) and a fresh state."""
        rng = np.random.default_rng(seed)
        ids = initial_ids(data.samples, self.n_components, rng)
        rows = np.zeros((len(ids), data.features))
        mine = data.mine(ids)
        rows[np.searchsorted(ids, mine)] = data.signals[mine - data.offset]
        if self.remove_mean:
            rows = without_means(rows)
        if comm is not None:  # each row is set by the rank that holds it, zeros elsewhere: the sum is exact
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, rows, op=MPI.SUM)
        self._state = DictionaryState.start(unit_atoms(rows, self.n_components, rng))
        return Iteration(self._rule(data.features), self._state, data.ranks, self.device)

    def _rule(self, features: int) -> Rule:
        sparsity = min(self.n_nonzero_coefs, features, self.n_components)
        return Rule(self.method, self.fit_algorithm, sparsity, float(self.alpha), self.forgetting, self.replace_after,
                    self.max_replace, self.duplicate_cosine, float(self.max_residual or 0.0),
                    bool(self.remove_mean))  # fmt: skip

    def _checked(self, comm: Comm | None, X: Any, reset: bool) -> tuple[np.ndarray, int]:
        """The signals as float64 rows, and the seed; a problem on any rank is raised on every rank."""
        checked: dict[str, Any] = {}

        def check() -> None:
            self._check_settings()
            least = 1 if comm is None else 0  # a rank may hold no rows; the world holds some (checked below)
            _refuse_records(X)
            checked["signals"] = validate_data(self, X, reset=reset, dtype=np.float64, ensure_min_samples=least)
            fixed = isinstance(self.random_state, (int, np.integer)) and not isinstance(self.random_state, bool)
            checked["seed"] = int(self.random_state if fixed else check_random_state(self.random_state).randint(2**31))

        _agreed(comm, check)
        signals = checked["signals"]
        largest = float(np.abs(signals).max()) if signals.size else 0.0
        shapes = [(signals.shape[1], largest, signals.shape[0])]
        if comm is not None:
            from mpi4py import MPI

            shapes = comm.allgather(shapes[0])
            largest = comm.allreduce(largest, op=MPI.MAX)
        problem = ""
        if len({features for features, _, _ in shapes}) > 1:
            problem = f"the ranks' rows differ in length: {[features for features, _, _ in shapes]} features"
        elif not sum(rows for _, _, rows in shapes):
            problem = "no rank passed any signals (0 samples); at least one is required"
        else:
            problem = scale_problem(largest)
        if problem:
            raise ValueError(f"{_WHAT}: {problem}")
        seeds = [checked["seed"]] if comm is None else comm.allgather(checked["seed"])
        return signals, seeds[0]  # rank 0's seed: a random_state of None draws one per rank

    def _check_settings(self) -> None:
        """The parameters as scikit-learn checks them: in ``fit``, not in ``__init__``."""
        problems = []
        for name in ("n_components", "n_nonzero_coefs", "batch_size", "n_iter", "replace_after", "max_replace",
                     "transform_max_iter"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an integer of at least 1, got {value!r}")
        for name in ("alpha", "shuffle_window_mib"):
            if not _positive(getattr(self, name)):
                problems.append(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if not (_number(self.forgetting) and self.forgetting >= 0 and math.isfinite(self.forgetting)):
            problems.append(f"forgetting must be a number >= 0, got {self.forgetting!r}")
        if not (_number(self.duplicate_cosine) and 0 < self.duplicate_cosine <= 1):
            problems.append(f"duplicate_cosine must be in (0, 1], got {self.duplicate_cosine!r}")
        for name, allowed in (("fit_algorithm", CODERS), ("method", METHODS), ("transform_algorithm", TRANSFORMS),
                              ("device", ("cpu", "cuda", "auto"))):  # fmt: skip
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.max_iter is not None and not (
            isinstance(self.max_iter, (int, np.integer)) and not isinstance(self.max_iter, bool) and self.max_iter >= 1
        ):
            problems.append(f"max_iter must be None or an integer of at least 1, got {self.max_iter!r}")
        if self.transform_n_nonzero_coefs is not None and not (
            isinstance(self.transform_n_nonzero_coefs, (int, np.integer)) and self.transform_n_nonzero_coefs >= 1
        ):
            wanted = self.transform_n_nonzero_coefs
            problems.append(f"transform_n_nonzero_coefs must be None or an integer of at least 1, got {wanted!r}")
        if self.transform_alpha is not None and not _positive(self.transform_alpha):
            problems.append(f"transform_alpha must be None or a positive number, got {self.transform_alpha!r}")
        for name in ("max_residual", "transform_max_residual"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and 0 <= value < math.inf):
                problems.append(f"{name} must be None or a number >= 0, got {value!r}")
        if self.max_residual is not None and self.fit_algorithm != "omp":
            problems.append("max_residual is an error target of fit_algorithm='omp'; lasso takes alpha")
        if problems:
            raise ValueError(f"{_WHAT}: " + "; ".join(problems))

    # ----------------------------------------------------------------- coding
    def transform(self, X: Any) -> np.ndarray:
        """Sparse codes of ``X`` (signals x atoms) with the learned dictionary, by ``transform_algorithm``.

        Rows are coded independently, so each rank codes its own rows, none on some; no communication.
        """
        check_is_fitted(self, "components_")
        self._check_settings()
        _refuse_records(X)
        signals = validate_data(self, X, reset=False, dtype=np.float64, ensure_min_samples=self._least_rows())
        if self.remove_mean:
            signals = without_means(signals)
        if self.transform_algorithm == "lasso_cd":
            alpha = self.alpha if self.transform_alpha is None else self.transform_alpha
            return lasso_encode(signals, self.components_, alpha, max_sweeps=self.transform_max_iter)
        wanted = self.n_nonzero_coefs if self.transform_n_nonzero_coefs is None else self.transform_n_nonzero_coefs
        target = self.max_residual if self.transform_max_residual is None else self.transform_max_residual
        device = "cpu" if target is not None else self.device
        return omp_encode(signals, self.components_, min(wanted, *self.components_.shape), device, target)

    def inverse_transform(self, X: Any) -> np.ndarray:
        """Signals back from codes: ``codes @ components_`` (with ``remove_mean``, without the means ``transform``
        took away: add them back from the signals)."""
        check_is_fitted(self, "components_")
        codes = check_array(X, dtype=np.float64, ensure_min_samples=self._least_rows())
        if codes.shape[1] != len(self.components_):
            raise ValueError(f"codes have one column per atom: {len(self.components_)}, got {codes.shape[1]}")
        return codes @ self.components_

    def _least_rows(self) -> int:
        """The fewest rows a call takes: one in a single process (as scikit-learn's estimators), none on a rank of
        several (the job's rows may leave a rank none, as ``fit`` allows)."""
        return 1 if _resolve(self.comm) is None else 0

    @property
    def _n_features_out(self) -> int:
        """Codes have one column per atom (for ``get_feature_names_out``)."""
        return self.components_.shape[0]


class _Rows:
    """This rank's signals within the global data set: the ranks' rows one after another in rank order."""

    def __init__(self, signals: np.ndarray, comm: Comm | None) -> None:
        self.signals, self.comm = signals, comm
        counts = [len(signals)] if comm is None else comm.allgather(len(signals))
        self.ranks, self.rank = len(counts), 0 if comm is None else comm.Get_rank()
        self.offset, self.samples, self.features = sum(counts[: self.rank]), sum(counts), signals.shape[1]

    def mine(self, ids: np.ndarray) -> np.ndarray:
        """The global ``ids`` (sorted or not) this rank holds, in their order."""
        return ids[(ids >= self.offset) & (ids < self.offset + len(self.signals))]

    def global_ids(self) -> np.ndarray:
        """Every signal of every rank (a batch of the whole data set)."""
        return np.arange(self.samples, dtype=np.int64)


def _resolve(comm: AnyComm | None) -> Comm | None:
    """The communicator to learn over: the one given, else the world of a launched job of several ranks, else none."""
    if comm is not None:
        resolved = as_mpi(comm)
        return resolved if resolved.Get_size() > 1 else None
    launched = "mpi4py.MPI" in sys.modules or any(os.environ.get(name) for name in RANK_VARIABLES)
    if not launched:
        return None
    refuse_unjoinable_launch()  # (srun without an MPI plugin: said here, before MPI starts and fails)
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def _together(comm: Comm | None, call: str) -> None:
    """Wait until every rank of ``comm`` has come to ``call``: MPI's collectives cannot time out, so a rank that
    never calls it would leave the others waiting without a word. A rank that is only late (reading its rows) is
    waited for, without spinning a core; inside ``mpiscale.run`` one that never comes ends the job with the runtime's
    report (see :func:`mpiscale.runtime.blocking_barrier`)."""
    entered_by_all(comm, f"{_WHAT}.{call}", f"call {call}",
                   "each rank must call it (one without rows passes an empty array)")  # fmt: skip


def _agreed(comm: Comm | None, action: Callable[[], None]) -> None:
    """``action()``; in one process its error as raised, across ranks the same ``ValueError`` on every rank."""
    if comm is None:
        action()
        return
    problem: Exception | None = None
    try:
        action()
    except (ValueError, TypeError) as error:  # agreed below, so no rank waits in a collective the others left
        problem = error
    agree(comm, problem, _WHAT, ValueError, entered=True)


def _refuse_records(X: Any) -> None:
    """Refuse a NumPy record array (a table of named fields) saying how to make it one array: scikit-learn's own
    words, "Cannot cast array data from dtype([('x', '<f4'), ...]) to dtype('float64')", say neither."""
    dtype = getattr(X, "dtype", None)
    if isinstance(dtype, np.dtype) and dtype.names:
        raise ValueError(f"X must be numbers, one signal per row; got {not_numbers(dtype)}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    return _number(value) and 0 < value < math.inf  # type: ignore[operator]  # a number, checked just before
