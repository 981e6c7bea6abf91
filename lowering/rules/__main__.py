import json
from pathlib import Path

from lowering.rules import coverage_markdown

# The accuracy section comes from the data file benchmarks/accuracy.py writes.
_ACCURACY = Path(__file__).resolve().parents[2] / "docs" / "accuracy.json"
runs = json.loads(_ACCURACY.read_text())["runs"] if _ACCURACY.exists() else None
print(coverage_markdown(runs), end="")
