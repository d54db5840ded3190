"""Compression of many LoRA adapters into shared components per layer group (``mpiscale compress-adapters``)."""

from .files import Adapter, AdapterError, find_adapters, open_adapter
from .pca import Components, shared_components

__all__ = ["Adapter", "AdapterError", "Components", "find_adapters", "open_adapter", "shared_components"]
