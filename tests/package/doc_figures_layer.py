"""Where each figure quoted in docs/weight_gradient.md, docs/fused_linear_cross_entropy.md and docs/op.md comes from: rows as in doc_figures.py."""

ROWS = [
]
