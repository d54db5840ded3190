"""The catalogue file's format and where each part lives in it (shared by its writer and its readers).

One HDF5 file, written by one process and readable with plain h5py:

- ``/models/NNNN``: a model the circuits read, by reference (attributes ``path``, ``sha256``,
  ``kind``: ``train`` for an mpiscale train results file, ``torchscript`` or ``export`` for a
  user's module); a train results file's weights are an external link ``weights`` into it,
  never a copy;
- ``/prefixes/NNNN``: a model up to one layer (attributes ``model``, ``layer``, ``width``) with
  the ``atoms`` (m x width, float32) its circuits project on and their rows in the table
  (``circuit``): the part every feature circuit of that layer shares;
- ``/spaces/NNNN``: embeddings of one kind (attributes ``name``, ``dimension``): ``vectors``
  (unit norm, float32), ``norm`` (their norms as given) and ``circuit``;
- ``/circuits/<column>``: one row per circuit: ``name`` (unique), ``prefix``, ``row`` (in its
  prefix's atoms), ``space``, ``space_row``, ``atom`` (the source's atom number, -1 for a
  supplied projection), ``usage`` (samples whose codes use it, -1 unknown), ``top_inputs``
  (n x top sample ids, -1 padding), ``top_labels`` (their labels as text), ``tags``
  (comma-separated), ``source`` and ``fields/<key>`` (the user's own columns, float64 or text).
"""

from __future__ import annotations

CATALOGUE_FORMAT = "mpiscale.circuits/1"

#: The kinds of model a prefix runs: mpiscale's train results, or a user's saved module.
MODEL_KINDS = ("train", "torchscript", "export")

#: Columns every circuit has (besides ``top_inputs``, ``top_labels`` and the user's ``fields/<key>``).
NUMBER_COLUMNS = ("prefix", "row", "space", "space_row", "atom", "usage")
TEXT_COLUMNS = ("name", "tags", "source")


def model_group(index: int) -> str:
    return f"models/{index:04d}"


def prefix_group(index: int) -> str:
    return f"prefixes/{index:04d}"


def space_group(index: int) -> str:
    return f"spaces/{index:04d}"
