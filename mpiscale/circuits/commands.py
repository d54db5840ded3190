"""``mpiscale circuits add`` and ``search``: the catalogue's own commands, in one process (their options are in
the command registry; ``similar`` is in :mod:`.similar_command`, ``run`` is a job)."""

from __future__ import annotations

import argparse
import json
import sys

SHOWN_COLUMNS = ("name", "model", "layer", "atom", "usage", "tags")


def _failed(command: str, error: Exception) -> int:
    print(f"mpiscale circuits {command}: {error}", file=sys.stderr)
    return 2


def add(args: argparse.Namespace) -> int:
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


def search(args: argparse.Namespace) -> int:
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
