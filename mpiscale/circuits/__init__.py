"""A catalogue of learned features as circuits: add, search, similar, and run them on data over the ranks.

The command-line parts are imported lazily (``mpiscale --help`` stays fast);
the library's public names are these.
"""

from .catalogue import Catalogue
from .filters import Filter, check_filters, matching, parse_filters
from .plan import PlanError, load_plan
from .store import CatalogueError, ModelRef, NewCircuits, add_circuits

__all__ = [
    "Catalogue",
    "CatalogueError",
    "Filter",
    "ModelRef",
    "NewCircuits",
    "PlanError",
    "add_circuits",
    "check_filters",
    "load_plan",
    "matching",
    "parse_filters",
]
