"""Exceptions the runtime catches without importing the passes."""


class SymbolicUnsupported(NotImplementedError):
    """A graph with symbolic (dynamic) dims that cannot be compiled shape-generic;
    the message says why. [Note: symbolic dims]"""
