"""Click data shaped like Criteo's, from a seeded generator (pure NumPy, no download).
(docs/MODULES.md, "hetps.app.clicks")"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ClickData", "auc", "power_law_ids"]

_PRIME = 2_147_483_647  # spreads ranks over ids (coprime with any row count below it)


def power_law_ids(rng: np.random.Generator, n: int, rows: int, alpha: float = 1.1) -> np.ndarray:
    """``n`` ids in ``[0, rows)``: rank ``k`` (1 = most frequent) has probability ~ k^-alpha,
    and ranks are spread over the ids by a fixed permutation (so hot ids are not 0, 1, 2...)."""
    u = rng.random(n)
    a = 1.0 - alpha
    rank = np.floor((((rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a))
    rank = np.clip(rank.astype(np.int64), 1, rows) - 1
    return (rank * (_PRIME % rows or 1) + 12345) % rows


def _hash_unit(x: np.ndarray, seed: int) -> np.ndarray:
    """A deterministic value in [-1, 1) per integer (splitmix64)."""
    z = x.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.float64) / (1 << 23) - 1.0


@dataclass
class ClickData:
    """The generator: ``batch(shard, step, size)`` -> (dense float32, ids int64, labels)."""

    rows: int = 100_000
    fields: int = 8
    dense: int = 13
    alpha: float = 1.1
    seed: int = 0

    def batch(self, shard: int, step: int, size: int):
        """Batch ``step`` of stream ``shard`` (a worker's rank; -1 for held-out data)."""
        rng = np.random.default_rng([self.seed, shard + 1, step])
        x = rng.standard_normal((size, self.dense)).astype(np.float32)
        ids = np.stack(
            [power_law_ids(rng, size, self.rows, self.alpha) for _ in range(self.fields)], 1
        )
        w = _hash_unit(np.arange(self.dense), self.seed + 7) * 0.3
        effect = sum(
            _hash_unit(ids[:, f] * self.fields + f, self.seed + 11) * 2.0
            for f in range(self.fields)
        )
        logit = x.astype(np.float64) @ w + effect / np.sqrt(self.fields) - 0.5
        y = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return x, ids, y


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    labels = np.asarray(labels).astype(bool)
    # each score's rank (from 1), tied scores the mean of their ranks
    _, tie, count = np.unique(scores, return_inverse=True, return_counts=True)
    r = (np.cumsum(count) - (count - 1) / 2)[tie.reshape(-1)]
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        raise ValueError("auc: needs both positive and negative labels")
    return float((r[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))
