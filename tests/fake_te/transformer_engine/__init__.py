"""A CPU stand-in for TransformerEngine, for tests only (see pytorch/__init__.py)."""

__version__ = "2.0.0"  # the oldest release model/te.py supports
