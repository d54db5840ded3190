"""Build the API reference (HTML) from the docstrings of mpiscale's public faces: ``make api``.

The reference documents what users import: the ``mpiscale`` package and the ``__init__`` of each
layer and workload (their modules are private to them). A warning of pdoc (a name that does not
resolve, a docstring it cannot render) fails the build, so ``make lint`` keeps the reference whole.
"""

import importlib
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("PDOC_ALLOW_EXEC", "1")  # platform.processor() runs uname at import

import pdoc  # noqa: E402

FACES = ["mpiscale", "mpiscale.runtime", "mpiscale.io", "mpiscale.jobs", "mpiscale.telemetry", "mpiscale.ranks",
         "mpiscale.errors", "mpiscale.dictlearn", "mpiscale.train", "mpiscale.train.pipeline", "mpiscale.memstore",
         "mpiscale.adapters", "mpiscale.circuits", "mpiscale.commands"]  # fmt: skip


def main(output: str) -> None:
    for name in FACES:  # lazy names (train loads torch on first use) loaded, so that pdoc sees them
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", []):
            getattr(module, public)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pdoc.render.configure(docformat="markdown", footer_text="mpiscale")
        pdoc.pdoc(*FACES, output_directory=Path(output))
    print(f"wrote the API reference of {len(FACES)} modules to {output}/index.html")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/api")
