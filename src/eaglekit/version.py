"""The eaglekit version: a module of its own, so that low-level modules (manifest) can name it without importing
the package facade in `eaglekit/__init__.py`, which sits above the stages."""

__version__ = "0.1.0"  # the same as pyproject.toml's version
