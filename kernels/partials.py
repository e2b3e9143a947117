"""The partials layout: what one rank's vocab slice contributes to a row's loss.

A flat fp32 tensor of ``partials_numel(n)`` elements for ``n`` token rows, written by every backend's
``shard_partials`` / ``linear_partials``, all-gathered over the tensor-parallel ranks in one
collective and finished by the backend's ``loss_from_partials``
(``mindspeed_cez.cross_entropy_zloss.VocabParallel.merged_loss``):

``[LOCAL_LSE * n, +n)``    this slice's log-sum-exp per row: ``m + log(sum exp(z - m))``, -inf for a
                           row that is -inf across the slice (such a slice adds nothing to the row)
``[TARGET_TERM * n, +n)``  ``(1-a)*z[target] + (a/V)*sum(z)`` (the z[target] part 0 where another rank
                           owns the target, NaN for an out-of-range target); summed over ranks
``[WIDTH * n, +2)``        the slice's width in columns as two exact fp32 words, ``width >> 12`` and
                           ``width & 4095``: ranks compare them to find unequal shards in the same collective

Over ranks the row's lse is the log-sum-exp of the slices' lse and its target term their sum.
"""

LOCAL_LSE, TARGET_TERM = 0, 1
PARTIAL_ROWS = 2  # rows of n values before the width words
WIDTH = PARTIAL_ROWS  # the width words start at WIDTH * n
WIDTH_WORDS = 2
WIDTH_SHIFT = 12
# The device-side assert's message where the width words differ (CUDA takes under 255 characters).
UNEQUAL_WIDTHS = "vocab shards of unequal width across tensor-parallel ranks: pad the vocab to a multiple of the TP size"


def partials_numel(n_rows):
    return PARTIAL_ROWS * n_rows + WIDTH_WORDS


def rows_of(numel):
    """The token rows of a partials tensor of ``numel`` elements."""
    return (numel - WIDTH_WORDS) // PARTIAL_ROWS


def row(partials, index, n_rows):
    """Row ``index`` (``LOCAL_LSE``, ``TARGET_TERM``) of partials, ``[..., n_rows]`` (a view)."""
    return partials[..., index * n_rows:(index + 1) * n_rows]


def width_words(width):
    """A slice's width as the two fp32-exact numbers the partials carry."""
    return float(width >> WIDTH_SHIFT), float(width & ((1 << WIDTH_SHIFT) - 1))


def widths(gathered):
    """Each rank's slice width from all-gathered ``[ranks, numel]`` partials (host values: reads the tensor)."""
    start = WIDTH * rows_of(gathered.shape[-1])
    words = gathered[:, start:start + WIDTH_WORDS].tolist()
    return [(int(hi) << WIDTH_SHIFT) + int(lo) for hi, lo in words]
