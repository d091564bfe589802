"""Horovod's ``DistributedOptimizer`` refuses a bad argument before it touches a store: the
first bad one by its order (op, compression, backward_passes_per_step, then the factor)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hetps.torch.collectives import Adasum, Compression, Sum  # noqa: E402
from hetps.torch.horovod import DistributedOptimizer  # noqa: E402

ADASUM = (
    "op=hvd.Adasum is Horovod's adaptive summation; hetps's servers sum: use op=hvd.Average "
    "(the default) or op=hvd.Sum"
)


class _NotACompression:
    def __repr__(self) -> str:
        return "NotACompression"


@pytest.mark.parametrize(
    "kw, text",
    [
        (dict(op=Adasum), ADASUM),
        (
            dict(compression=_NotACompression()),
            "compression=NotACompression: DistributedOptimizer takes hvd.Compression.none or "
            "hvd.Compression.fp16",
        ),
        (
            dict(backward_passes_per_step=True),
            "backward_passes_per_step must be an int >= 1, not True",
        ),
        (dict(backward_passes_per_step=0), "backward_passes_per_step must be an int >= 1, not 0"),
        (dict(gradient_predivide_factor=0), "gradient_predivide_factor must be > 0, not 0.0"),
        (
            dict(gradient_predivide_factor=2.0, op=Sum),
            "gradient_predivide_factor applies to op=hvd.Average only",
        ),
        (
            dict(compression=Compression.fp16, update_on="server"),
            "compression, gradient_predivide_factor and backward_passes_per_step work on the "
            "gradients a worker steps with: they need update_on='worker'",
        ),
        # an earlier refusal wins over a factor that is no number (float() is not reached)
        (dict(op=Adasum, gradient_predivide_factor=None), ADASUM),
        (
            dict(compression=_NotACompression(), gradient_predivide_factor="x"),
            "compression=NotACompression: DistributedOptimizer takes hvd.Compression.none or "
            "hvd.Compression.fp16",
        ),
        (
            dict(backward_passes_per_step=0, gradient_predivide_factor=None),
            "backward_passes_per_step must be an int >= 1, not 0",
        ),
    ],
)
def test_the_first_bad_argument_is_refused_by_name(kw, text):
    with pytest.raises(ValueError) as exc:
        DistributedOptimizer(None, None, **kw)
    assert str(exc.value) == text
