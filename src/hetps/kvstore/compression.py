"""MXNet's 2-bit gradient compression with error feedback, bit-exact and vectorised.
(docs/MODULES.md, "hetps.kvstore.compression")"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetps.optim import kernels

__all__ = ["TwoBitCompressor", "parse_compression_params"]

#: Values packed into one 32-bit word.
VALUES_PER_WORD = 16

# Shift of the bit pair of value (j & 3) inside its byte: 0xc0 -> 6, 0x30 -> 4, ...
_PAIR_SHIFTS = np.array([6, 4, 2, 0], dtype=np.uint8)
# Multiplier that gathers 4 one-byte flags of a little-endian uint32 into bits 30, 28, 26, 24.
_SPREAD = np.uint32(0x40100401)
# Values processed per chunk in compress() (a multiple of 16).
_CHUNK = 1 << 16


class TwoBitCompressor:
    """MXNet-compatible 2-bit quantizer with a residual (error-feedback) buffer per key.

    The compressor itself is stateless; the caller owns one float32 residual array per key
    (zeros at first, same number of elements as the gradient) and passes it to
    :meth:`compress`, which updates it in place.

    Args:
        threshold: the quantisation threshold ``t > 0``; values decode to ``-t``, ``0`` or
            ``+t``. Stored as float32, as MXNet does.
    """

    def __init__(self, threshold: float) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError(f"threshold must be a real number, got {threshold!r}")
        if not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
        t32 = np.float32(threshold)
        if not t32 > 0 or not np.isfinite(t32):
            raise ValueError(f"threshold {threshold!r} is not a positive float32")
        self.threshold = float(threshold)
        self._t32 = t32

    @staticmethod
    def compressed_size(n: int) -> int:
        """Number of uint32 words that hold ``n`` compressed values: ``ceil(n / 16)``."""
        return (n + VALUES_PER_WORD - 1) // VALUES_PER_WORD

    def compress(self, grad: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """Quantise ``grad`` (plus the carried ``residual``) into packed 2-bit codes.

        Args:
            grad: gradient of any float dtype and shape; read flattened (C order). Converted to
                float32 first (exact for float16; float64 is rounded, as MXNet only has a
                float32 kernel).
            residual: float32 array with ``grad.size`` elements, updated in place.

        Returns:
            ``uint32`` array of ``ceil(grad.size / 16)`` words in MXNet's layout (docs/MODULES.md,
            "hetps.kvstore.compression"); its little-endian bytes are the bytes MXNet sends.
        """
        grad = np.asarray(grad)
        if grad.dtype.kind != "f":
            raise TypeError(f"grad must be a float array, got dtype {grad.dtype}")
        if not isinstance(residual, np.ndarray) or residual.dtype != np.float32:
            raise TypeError(
                "residual must be a float32 NumPy array (create it with "
                "np.zeros(grad.size, np.float32)); got "
                f"{getattr(residual, 'dtype', type(residual).__name__)}"
            )
        n = grad.size
        if residual.size != n:
            raise ValueError(
                f"residual has {residual.size} elements but grad has {n}; keep one residual "
                "per key, the size of its gradient"
            )
        # A flat view of the residual that writes through; a copy written back at the end if
        # the residual is not contiguous.
        writeback = not residual.flags.c_contiguous
        res = residual.ravel() if writeback else residual.reshape(-1)
        flat_grad = grad.reshape(-1)

        words = self.compressed_size(n)
        out = np.empty(words * 4, dtype=np.uint8)
        # Work in cache-sized chunks (a multiple of 16 values): a handful of passes over each
        # chunk with reused scratch buffers is ~10x faster than whole-array temporaries.
        chunk = max(min(_CHUNK, words * VALUES_PER_WORD), VALUES_PER_WORD)
        pos = np.zeros(chunk, dtype=np.bool_)
        neg = np.zeros(chunk, dtype=np.bool_)
        sign = np.empty(chunk, dtype=np.int8)
        adj = np.empty(chunk, dtype=np.float32)
        pos_word = np.empty(chunk // 4, dtype=np.uint32)
        code_word = np.empty(chunk // 4, dtype=np.uint32)
        t = self._t32
        neg_t = -t
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            m = stop - start
            r = res[start:stop]
            g = flat_grad[start:stop]
            if g.dtype != np.float32:
                # round to float32 first, as MXNet's float32 kernel sees the gradient
                np.copyto(adj[:m], g, casting="same_kind")
                g = adj[:m]
            r += g
            p, q = pos[:m], neg[:m]
            np.greater_equal(r, t, out=p)
            np.less_equal(r, neg_t, out=q)
            # residual -= t where pos, += t where neg: r - (+-1 * t) is exactly r -+ t
            sg = sign[:m]
            np.subtract(p.view(np.int8), q.view(np.int8), out=sg)
            a = adj[:m]
            np.multiply(sg, t, out=a)
            r -= a
            # Pack: viewing 4 bools as a little-endian uint32 (one byte each, 0 or 1), the
            # multiply by 0x40100401 moves bool i (bit 8i) to bit 30 - 2i, no carries, so
            # bits 24..31 hold  b0<<6 | b1<<4 | b2<<2 | b3  -- MXNet's bit pairs in a byte.
            padded = -(-m // VALUES_PER_WORD) * VALUES_PER_WORD
            pos[m:padded] = False
            neg[m:padded] = False
            k = padded // 4
            pw, cw = pos_word[:k], code_word[:k]
            np.multiply(pos[:padded].view("<u4"), _SPREAD, out=pw)
            pw >>= np.uint32(24)
            np.multiply(neg[:padded].view("<u4"), _SPREAD, out=cw)
            cw >>= np.uint32(24)
            # code = (pos | neg) << 1 | pos: 0b11 for pos, 0b10 for neg (never both: t > 0)
            cw |= pw
            cw <<= np.uint32(1)
            cw |= pw
            out[start // 4 : start // 4 + k] = cw
        if writeback:
            residual[...] = res.reshape(residual.shape)
        return out.view("<u4").astype(np.uint32, copy=False)

    def decompress(
        self,
        packed: np.ndarray,
        n: int,
        dtype: Any = np.float32,
        *,
        out: np.ndarray | None = None,
        add: bool = False,
    ) -> np.ndarray:
        """Decode the first ``n`` values of ``packed`` into a flat array of ``dtype``.

        Args:
            packed: ``uint32`` words as returned by :meth:`compress` (at least
                ``ceil(n / 16)`` of them).
            n: number of values to decode.
            dtype: float dtype of the result; values are ``-t``, ``0`` or ``+t`` with ``t``
                the float32 threshold converted to ``dtype``.
            out: decode into this contiguous 1-D array of ``n`` values of ``dtype`` (no new
                array; chunk by chunk on the kernel threads, see :mod:`hetps.optim.kernels`)
                instead of a new one.
            add: with ``out``: add the decoded values to ``out`` (``out += decoded``, the
                same sums as adding a decoded array) instead of overwriting it.

        Returns:
            A new 1-D array of ``n`` elements, or ``out``.
        """
        packed = np.asarray(packed)
        if packed.dtype != np.uint32:
            raise TypeError(f"packed must be a uint32 array, got dtype {packed.dtype}")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        n = int(n)
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a float dtype, got {dtype}")
        words = self.compressed_size(n)
        if packed.size < words:
            raise ValueError(
                f"{packed.size} packed words cannot hold {n} values (need {words} = ceil(n/16))"
            )
        raw = packed.reshape(-1)[:words].astype("<u4", copy=False).view(np.uint8)
        table = self._table(dtype)  # byte value -> its 4 decoded values, shape (256, 4)
        if out is None:
            if add:
                raise ValueError("decompress(add=True) needs the array to add to (out=)")
            return np.take(table, raw, axis=0).reshape(-1)[:n]
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != dtype
            or out.size != n
            or out.ndim != 1
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError(
                f"out must be a writeable contiguous 1-D array of {n} {dtype} values, got "
                f"{getattr(out, 'shape', None)} {getattr(out, 'dtype', type(out).__name__)}"
            )
        # a chunk starts at a multiple of 16 values (CHUNK is): value i is in byte i // 4
        nbytes = -(-n // 4)

        def body(views: list, scratch: list, start: int) -> None:
            (dst,) = views
            m = dst.size
            src = raw[start // 4 : min(nbytes, -(-(start + m) // 4))]
            dec = scratch[0] if src.size * 4 == m else np.empty(src.size * 4, dtype)
            np.take(table, src, axis=0, out=dec.reshape(-1, 4), mode="clip")
            if add:
                np.add(dst, dec[:m], out=dst)
            else:
                np.copyto(dst, dec[:m])

        kernels.run(body, [out], scratch=1, dtype=dtype, offset=True)
        return out

    def _table(self, dtype: np.dtype) -> np.ndarray:
        """The (256, 4) decode table for ``dtype`` (built once per dtype)."""
        tables = self.__dict__.setdefault("_tables", {})
        table = tables.get(dtype)
        if table is None:
            t = self._t32.astype(dtype)
            by_code = np.array([0, 0, -t, t], dtype=dtype)
            byte_codes = (np.arange(256, dtype=np.uint8)[:, None] >> _PAIR_SHIFTS) & np.uint8(3)
            table = tables[dtype] = by_code[byte_codes]
        return table

    def __repr__(self) -> str:
        return f"TwoBitCompressor(threshold={self.threshold!r})"


def parse_compression_params(params: Mapping[str, Any] | None) -> TwoBitCompressor | None:
    """Validate MXNet's ``set_gradient_compression`` dict and build the compressor.

    Accepted forms: ``{'type': '2bit', 'threshold': 0.5}`` (threshold defaults to 0.5, as in
    MXNet, and may be a numeric string, as MXNet passes it to the backend as text) and
    ``{'type': 'none'}`` (no compression: returns ``None``).

    Raises:
        ValueError: a missing or unknown ``type``, an unknown key, or a threshold that is not a
            number ``> 0``; the message names the key and the fix.
        TypeError: ``params`` is not a dict.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise TypeError(
            "gradient compression params must be a dict such as "
            f"{{'type': '2bit', 'threshold': 0.5}}, got {type(params).__name__}"
        )
    if "type" not in params:
        raise ValueError(
            "gradient compression params need a 'type' key: use "
            "{'type': '2bit', 'threshold': 0.5} or {'type': 'none'}"
        )
    ctype = params["type"]
    if not isinstance(ctype, str) or ctype.lower() not in ("2bit", "none"):
        raise ValueError(
            f"gradient compression 'type' {ctype!r} is not supported; use '2bit' or 'none'"
        )
    ctype = ctype.lower()
    allowed = {"type"} if ctype == "none" else {"type", "threshold"}
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        raise ValueError(
            f"unknown gradient compression key(s) {unknown} for type {ctype!r}; "
            f"allowed keys: {sorted(allowed)}"
        )
    if ctype == "none":
        return None

    raw = params.get("threshold", 0.5)
    threshold: float
    if isinstance(raw, bool):
        threshold = math.nan
    elif isinstance(raw, numbers.Real):
        threshold = float(raw)
    elif isinstance(raw, str):
        try:
            threshold = float(raw)
        except ValueError:
            threshold = math.nan
    else:
        threshold = math.nan
    if not (math.isfinite(threshold) and threshold > 0 and np.float32(threshold) > 0):
        raise ValueError(
            f"gradient compression 'threshold' must be a number > 0, got {raw!r}; "
            "e.g. {'type': '2bit', 'threshold': 0.5}"
        )
    return TwoBitCompressor(threshold)
