"""Where each figure quoted in docs/z_loss_training.md comes from, beyond the rows in doc_figures.py: rows as there."""

ROWS = [
]
