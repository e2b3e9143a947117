"""Where each figure quoted in docs/performance.md and bench/README.md comes from: rows as in doc_figures.py."""

ROWS = [
]
