"""Where each figure quoted in docs/adaptor.md, docs/megatron_features.md, docs/ascend.md, docs/install.md, docs/architecture.md and examples/README.md comes from: rows as in doc_figures.py."""

ROWS = [
]
