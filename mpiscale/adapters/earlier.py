"""An earlier compressed file that new adapters join (``compress-adapters --add-to``), read from the file alone.

A group's second moment is a sum over adapters, so with new adapters it is
the earlier adapters' moment plus theirs. The earlier file keeps, per group
and side, the components and how much each explains (and the whole sum of
squares), which is the moment of its adapters as rebuilt: the k rows
``sqrt(variance) x component``. Components found from those rows together
with the new adapters' are those of compressing the rebuilt earlier adapters
and the new ones in one run; the earlier adapters' weights are not needed
(they are often deleted once compressed). What the earlier components left
out still counts in the total, so the explained shares stay shares of
everything.

An earlier adapter's new loadings project its rebuilt matrices on the new
components (``L C_old C_new^T``). Its error against its original weights is
no longer known exactly, only bounded: its earlier error plus the distance
between its earlier and its new rebuilt update (triangle inequality; both
are exact, from r x r products). The file says which errors are bounds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..io import open_file
from .files import Adapter, Module
from .layout import ADAPTERS_FORMAT, group_name


@dataclass(frozen=True)
class Earlier:
    """The earlier file's adapters (their table rows) and the shape of their groups (``reference``)."""

    path: str
    reference: Adapter  # the first earlier adapter's settings, with the file's modules and rank
    table: dict[str, np.ndarray]  # adapters/{name, path, sha256, config}: one row per earlier adapter
    count: int

    @classmethod
    def open(cls, path: str) -> Earlier:
        """Read the table and shapes of ``path`` (a DataFileError, a ValueError, if it cannot be joined)."""
        with open_file(path, (ADAPTERS_FORMAT,)) as file:
            table = {key: file[f"adapters/{key}"][()] for key in ("name", "path", "sha256", "config")}
            rank = int(file.attrs["rank"])
            modules = []
            for index, name in enumerate(file["modules"][()]):
                group = file[group_name(index)]
                modules.append(Module(name.decode(), group["A/components"].shape[1], group["B/components"].shape[1]))
        config = json.loads(table["config"][0])
        reference = Adapter(table["name"][0].decode(), path, config, rank, tuple(modules))
        return cls(path, reference, table, len(table["name"]))

    def side(self, group: int, side: str) -> tuple[np.ndarray, float]:
        """A group side's moment as rows (k x d, float64), and the sum of squares its components left out."""
        with open_file(self.path, (ADAPTERS_FORMAT,)) as file:
            found = file[f"{group_name(group)}/{side}"]
            components, explained = found["components"][()].astype(np.float64), found["explained"][()]
            total = float(found["total"][0])
        variances = explained * total
        return np.sqrt(variances)[:, None] * components, max(total - float(variances.sum()), 0.0)

    def reprojected(
        self, group: int, first: int, stop: int, new: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Earlier adapters ``first:stop``'s loadings on the ``new`` components of both sides, their update's squared
        norm, and a bound on their squared error against their original weights.

        With Q the new projections and M = B'A' the earlier rebuilt update, the
        new one is Q_B M Q_A, an orthogonal projection of M, so
        ||M - Q_B M Q_A||^2 = ||M||^2 - ||Q_B M Q_A||^2.
        """
        with open_file(self.path, (ADAPTERS_FORMAT,)) as file:
            found = file[group_name(group)]
            norm = found["norm"][first:stop].astype(np.float64)
            residual = found["error"][first:stop] * norm  # ||B A - M||, or a bound on it
            loadings, moved = {}, np.zeros(stop - first)
            old = {side: found[f"{side}/loadings"][first:stop].astype(np.float64) for side in "AB"}
            for side in "AB":
                turn = found[f"{side}/components"][()].astype(np.float64) @ new[side].T
                loadings[side] = old[side] @ turn
        for i in range(stop - first):
            before, after = update_norm2(old["A"][i], old["B"][i]), update_norm2(loadings["A"][i], loadings["B"][i])
            moved[i] = max(before - after, 0.0)
        bound = residual + np.sqrt(moved)
        return loadings, norm**2, bound**2


def update_norm2(a_rows: np.ndarray, b_rows: np.ndarray) -> float:
    """||B A||^2 from r x r products, ``a_rows`` being A (r x in) and ``b_rows`` B^T (r x out): tr(B^T B A A^T).

    The same for a rebuilt update from its loadings (r x k each): the components are orthonormal.
    """
    return float(np.einsum("ij,ji->", b_rows @ b_rows.T, a_rows @ a_rows.T))
