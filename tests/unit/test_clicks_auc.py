"""hetps.app.clicks.auc: the area under the ROC curve, tied scores counted half."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.app.clicks import auc


@pytest.mark.parametrize(
    ("labels", "scores", "want"),
    [
        ([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8], 0.75),  # one pair of four out of order
        ([0, 1], [0.5, 0.5], 0.5),  # a tie counts half
        ([0, 0, 1, 1], [1, 2, 2, 3], 0.875),  # (neg 2, pos 2) tied, the other three right
        ([1, 0, 1, 0], [3, 2, 3, 2], 1.0),
        ([1, 1, 0, 0], [1, 1, 1, 1], 0.5),  # all tied
    ],
)
def test_auc_counts_each_pair_and_ties_half(labels, scores, want):
    assert auc(np.array(labels), np.array(scores, dtype=float)) == pytest.approx(want)


def test_auc_equals_the_pair_count_on_random_ties():
    rng = np.random.default_rng(7)
    y = rng.integers(0, 2, 200)
    s = rng.integers(0, 6, 200).astype(float)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert auc(y, s) == pytest.approx(pairs / (len(pos) * len(neg)))


def test_auc_needs_both_labels():
    with pytest.raises(ValueError, match="both positive and negative"):
        auc(np.array([1, 1]), np.array([0.2, 0.3]))
