"""A catalogue of learned features as circuits: add, search, similar, and run them on data over the ranks.

The command-line parts are imported lazily (``mpiscale --help`` stays fast);
import the library modules directly: ``mpiscale.circuits.store``,
``.catalogue``, ``.filters``, ``.similar``, ``.features``.
"""
