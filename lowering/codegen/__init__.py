"""Renderers: a ``Schedule`` to Python source. Renderers hold no fusion logic."""
