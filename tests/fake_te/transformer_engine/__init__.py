"""A CPU stand-in for TransformerEngine, for tests only (see pytorch/__init__.py)."""
