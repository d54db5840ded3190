"""The package version, in a module of its own: the files mpiscale writes stamp it, and the package imports them."""

__version__ = "0.1.0"
