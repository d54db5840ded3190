"""One adapter rebuilt from a compressed file and written back in the PEFT format (``compress-adapters export``).

Its matrices are its loadings times the shared components of every group
(float32, as PEFT saves them), its adapter_config.json the one it had, so
``PeftModel.from_pretrained(base, DIRECTORY)`` loads it as it loaded the
original.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from ..errors import MpiscaleError
from ..io import open_file
from .files import AdapterError, write_adapter
from .layout import READABLE_FORMATS, group_name
from .results import group_names


def export_adapter(compressed: str, name: str, directory: str) -> dict[str, np.ndarray]:
    """Write adapter ``name`` of ``compressed`` into the new ``directory``; returns its tensors."""
    if os.path.exists(directory):
        raise AdapterError(directory, "exists already: give a new directory (an adapter is never written over)")
    with open_file(compressed, READABLE_FORMATS) as file:
        names = [value.decode() for value in file["adapters/name"][()]]
        if name not in names:
            listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise AdapterError(compressed, f"holds no adapter named {name!r}; it holds {listed}")
        row = names.index(name)
        settings = json.loads(file["adapters/config"][row])
        tensors = {}
        for index, module in enumerate(group_names(file)):
            group = file[group_name(index)]
            a = group["A/loadings"][row].astype(np.float64) @ group["A/components"][()]
            b = (group["B/loadings"][row].astype(np.float64) @ group["B/components"][()]).T
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    write_adapter(Path(directory), tensors, settings)
    return tensors


def command(args: argparse.Namespace) -> int:
    """``mpiscale compress-adapters export FILE NAME [--to DIRECTORY]``: one process, no MPI job."""
    directory = args.to or args.name
    try:
        tensors = export_adapter(args.compressed, args.name, directory)
    except (MpiscaleError, OSError) as error:
        print(f"mpiscale compress-adapters export: {error}", file=sys.stderr)
        return 2
    print(f"wrote {directory}: adapter {args.name} rebuilt from {args.compressed} ({len(tensors) // 2} modules)")
    return 0
