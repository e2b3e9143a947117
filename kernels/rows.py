"""The row layout every kernel takes: ``[n, k]`` with unit stride along ``k``."""


def as_rows(t):
    """``[..., k]`` -> ``[n, k]`` with unit last-dim stride (a view whenever the layout allows)."""
    rows = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
