"""``mpiscale circuits add | search | similar``: the catalogue's own commands (``run`` is a job: the registry's).

``add`` and ``search`` run in one process. ``similar`` runs in one process or
under the launcher, each rank searching its block of the embeddings.
"""

from __future__ import annotations

import argparse
import json
import sys

SHOWN_COLUMNS = ("name", "model", "layer", "atom", "usage", "tags")


def add_commands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The ``circuits`` command and its sub-commands; returns its sub-parsers (the jobs add ``run``)."""
    circuits = commands.add_parser(
        "circuits",
        help="a catalogue of learned features as circuits: add, search, similar, run",
        description="Keep features as circuits (a model up to a layer, then an atom) in one HDF5 catalogue, search "
        "them by metadata and by similarity, and run them on data.",
    )
    actions = circuits.add_subparsers(dest="circuits_command", required=True)

    add = actions.add_parser(
        "add",
        help="add a dictlearn results file's atoms, or a saved module, to a catalogue (created if missing)",
        description="Add circuits to CATALOGUE.h5: each atom of a dictlearn results file (its model and layer found "
        "through its activations file, or given), or a user's module saved with torch.export or TorchScript.",
    )
    add.add_argument("catalogue", metavar="CATALOGUE.h5")
    source = add.add_mutually_exclusive_group(required=True)
    source.add_argument("--dictlearn", metavar="RESULTS.h5", help="a dictlearn results file: one circuit per atom")
    source.add_argument("--module", metavar="FILE.pt2", help="a module saved by torch.export.save or torch.jit.save")
    add.add_argument("--model", default="", help="--dictlearn: the train results file (default: the one its "
                     "activations file names)")  # fmt: skip
    add.add_argument("--layer", default="", help="--dictlearn: the layer (default: the activations' data set name)")
    add.add_argument("--data", default="", metavar="FILE.h5:/X", help="--dictlearn: the activations (default: the "
                     "run's data)")  # fmt: skip
    add.add_argument("--top", type=int, default=5, help="--dictlearn: top inputs kept per atom (0: skip the pass "
                     "over the data; default: 5)")  # fmt: skip
    add.add_argument("--name", default="", help="--module: the circuit's name (several outputs: NAME/0, NAME/1 ...)")
    add.add_argument("--inputs", type=int, default=0, help="--module: numbers per input row it takes")
    add.add_argument("--input-dtype", default="float32", choices=["float32", "float64", "int64"],
                     help="--module: the type of its inputs (default: float32)")  # fmt: skip
    add.add_argument("--projections", default="", metavar="FILE.npy", help="--module: project its output on these rows "
                     "(FILE.npy or FILE.h5:/X; default: one circuit per output number)")  # fmt: skip
    add.add_argument("--tag", action="append", default=[], help="a tag for every circuit added (repeatable)")
    add.add_argument("--field", action="append", default=[], metavar="KEY=VALUE",
                     help="a field for every circuit added (repeatable; numbers where VALUE is one)")  # fmt: skip
    add.add_argument("--fields", default="", metavar="FILE.json", help="fields from JSON: one object for all, or a "
                     "list of one object per circuit")  # fmt: skip
    add.add_argument("--embeddings", default="", metavar="FILE.npy", help="one vector per circuit for similarity "
                     "search (FILE.npy or FILE.h5:/X; default: the atoms)")  # fmt: skip
    add.add_argument("--space", default="", help="the embeddings' space name (default: MODEL:LAYER)")
    add.set_defaults(handler=_add)

    search = actions.add_parser("search", help="circuits whose metadata match filters",
                                description="List the circuits matching every --where filter.")  # fmt: skip
    search.add_argument("catalogue", metavar="CATALOGUE.h5")
    _filter_options(search)
    search.add_argument("--limit", type=int, default=20, help="circuits to print (default: 20; 0: all)")
    search.add_argument("--json", metavar="FILE.json", help="also write every match, with all columns, as JSON")
    search.set_defaults(handler=_search)

    similar = actions.add_parser(
        "similar",
        help="the circuits nearest a circuit or a vector (exact cosine top-k, over the ranks)",
        description="Exact cosine top-k over one embedding space, after the --where filters; under the launcher "
        "each rank searches its block.",
    )
    similar.add_argument("catalogue", metavar="CATALOGUE.h5")
    similar.add_argument("--to", action="append", default=[], metavar="NAME", help="a circuit (repeatable)")
    similar.add_argument("--vector", metavar="FILE.npy", help="query vectors: one, or a matrix of one per row "
                         "(FILE.npy or FILE.h5:/X)")  # fmt: skip
    similar.add_argument("--space", default="", help="the space to search (default: the circuit's, or the only one "
                         "of the vector's length)")  # fmt: skip
    similar.add_argument("-k", type=int, default=10, help="neighbours per query (default: 10)")
    _filter_options(similar)
    similar.add_argument("--json", metavar="FILE.json", help="also write the neighbours as JSON")
    similar.set_defaults(handler=_similar)
    return actions


def _filter_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--where", action="append", default=[], metavar="FILTER",
                         help="KEY=VALUE (* and ? match), KEY!=VALUE, KEY>=N, KEY<N ..., tag=NAME; repeatable, and "
                         "';' separates several in one (all must hold)")  # fmt: skip


def _failed(command: str, error: Exception) -> int:
    print(f"mpiscale circuits {command}: {error}", file=sys.stderr)
    return 2


def _add(args: argparse.Namespace) -> int:
    from ..errors import MpiscaleError
    from .sources import from_dictlearn, from_module, parse_fields, read_matrix
    from .store import add_circuits

    try:
        if args.dictlearn:
            batch = from_dictlearn(args.dictlearn, args.model, args.layer, args.top, args.data)
        else:
            batch = from_module(args.module, args.name, args.inputs, args.input_dtype, args.projections)
        batch.tags = args.tag
        batch.fields = parse_fields(args.field, args.fields, batch.count)
        batch.space = args.space
        if args.embeddings:
            batch.embeddings = read_matrix(args.embeddings)
        total = add_circuits(args.catalogue, batch)
    except (MpiscaleError, ValueError, OSError) as error:
        return _failed("add", error)
    where = f"layer {batch.layer} of " if batch.layer else ""
    print(f"added {batch.count} circuits ({where}{batch.model.path}) to {args.catalogue}: {total} in all")
    return 0


def _search(args: argparse.Namespace) -> int:
    import numpy as np

    from ..errors import MpiscaleError
    from .catalogue import Catalogue
    from .filters import check_filters, matching, parse_filters

    try:
        filters = parse_filters(args.where)
        with Catalogue(args.catalogue) as catalogue:
            check_filters(catalogue, filters)
            rows = np.flatnonzero(matching(catalogue, filters))
            columns = {key: catalogue.column(key)[rows] for key in (*SHOWN_COLUMNS, *catalogue.fields())}
            columns["top_inputs"] = catalogue.file["circuits/top_inputs"][()][rows] if len(rows) else np.empty((0, 0))
            total = catalogue.count
    except (MpiscaleError, ValueError) as error:
        return _failed("search", error)
    shown = len(rows) if args.limit == 0 else min(args.limit, len(rows))
    print(f"{len(rows)} of {total} circuits match" + (f"; the first {shown}:" if shown < len(rows) else ":"))
    for index in range(shown):
        print("  " + _describe({key: values[index] for key, values in columns.items()}))
    if args.json:
        records = [_record(columns, index, int(row)) for index, row in enumerate(rows)]
        _write_json(args.json, records)
    return 0


def _describe(row: dict) -> str:
    top = [str(v) for v in row.get("top_inputs", []) if v >= 0]
    tags = f" [{row['tags']}]" if row["tags"] else ""
    usage = f" used by {row['usage']}" if row["usage"] >= 0 else ""
    where = f"{row['model']} {row['layer'] or 'output'} atom {row['atom']}"
    return f"{row['name']}: {where}{usage}{tags}" + (f"; top inputs {', '.join(top)}" if top else "")


def _record(columns: dict, index: int, row: int) -> dict:
    record: dict = {"row": row}
    for key, values in columns.items():
        value = values[index]
        record[key] = value.tolist() if hasattr(value, "tolist") else value
    return record


def _write_json(path: str, document) -> None:
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(document, stream, indent=1)
    print(f"wrote {path}")


def _similar(args: argparse.Namespace) -> int:
    from .similar_command import similar_command

    return similar_command(args)
