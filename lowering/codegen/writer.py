"""An indented source writer."""
from __future__ import annotations

import contextlib


class SourceWriter:
    def __init__(self, indent: int = 0):
        self.lines: list[str] = []
        self.level = indent

    def line(self, text: str = ""):
        self.lines.append(("    " * self.level + text) if text else "")

    @contextlib.contextmanager
    def indent(self):
        self.level += 1
        try:
            yield
        finally:
            self.level -= 1

    def source(self) -> str:
        return "\n".join(self.lines) + "\n"
