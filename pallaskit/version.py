"""The package version (its own module: the cache key reads it without importing the package)."""
__version__ = "0.1.0"
