"""Every exception class mpiscale defines belongs to one family: ``except MpiscaleError`` catches them all."""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import mpiscale
from mpiscale.errors import MpiscaleError

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"
NEEDS_TORCH = ("mpiscale.train", "mpiscale.circuits", "mpiscale.bench")


def _exception_classes() -> dict[str, type]:
    """Every exception class defined in a module of the package, by qualified name."""
    found: dict[str, type] = {}
    for module_info in pkgutil.walk_packages(mpiscale.__path__, "mpiscale."):
        if module_info.name.endswith("_cuda"):  # needs a GPU driver's Numba target to import
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_class_derives_from_mpiscale_error():
    classes = _exception_classes()
    assert len(classes) >= 25  # the walk found the package's exceptions, not none
    assert {"mpiscale.ranks.AgreedError", "mpiscale.telemetry.remote.JobEnded"} <= set(classes)
    outside = sorted(name for name, kind in classes.items() if not issubclass(kind, MpiscaleError))
    assert outside == []


def _public_names() -> set[str]:
    """Exception classes a user can import from a public face: a package's ``__init__`` (lazy names included), or
    ``mpiscale.ranks``."""
    faces = [mpiscale, importlib.import_module("mpiscale.ranks")]
    faces += [importlib.import_module(info.name) for info in pkgutil.walk_packages(mpiscale.__path__, "mpiscale.")
              if info.ispkg]  # fmt: skip
    names = set()
    for face in faces:
        for name in [*vars(face), *getattr(face, "__all__", [])]:
            value = getattr(face, name, None)
            if inspect.isclass(value) and issubclass(value, BaseException):
                names.add(value.__name__)
    return names


def test_the_guide_lists_every_public_exception():
    table = GUIDE.read_text()
    listed = set(re.findall(r"^\| `(\w+)` \(`mpiscale[\w.]*`\)", table, re.MULTILINE))
    public = _public_names()
    assert {"AgreedError", "ScheduleError", "CatalogueError", "Rejected"} <= public
    assert sorted(public - listed - {"MpiscaleError"}) == []
