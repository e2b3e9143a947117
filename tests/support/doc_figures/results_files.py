"""The committed results files under bench/results/, as the figure registry (this package) reads them."""
import json
import os
from decimal import ROUND_HALF_UP, Decimal

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def load(path):
    """A results file by its path from the repository root: JSON parsed, any other file as its text."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return json.load(fh) if path.endswith(".json") else fh.read()


def half_up(value, places=0):
    """A printed decimal rounded half up, as a reader rounds "0.075" to "0.08" (not as its binary float does)."""
    return str(Decimal(str(value)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))
