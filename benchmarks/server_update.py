#!/usr/bin/env python
"""A server's optimizer step and merge on one big key, against bare in-place torch, in one run.

    .venv/bin/python benchmarks/server_update.py [--elems 11700000] [--rounds 15] [--threads N]
        [--quick]

For each case the key (float32, ``--elems`` values: 11.7M is resnet18's size) is updated
``--rounds`` times by:

* hetps: the server's own call, ``optimizer.apply_update(key, weight, grad, state, sender)``
  (what ``KVServer`` runs when a round completes), or for the merge the server's sum of a
  second push into the first;
* bare torch: the same arithmetic written directly as in-place torch ops on
  ``torch.from_numpy`` views of preallocated arrays (``mul_``, ``add_(alpha=)``,
  ``addcmul_``, ``addcdiv_``, ``sqrt(out=)``), no checks, no temporaries, torch using the
  same number of threads;
* whole-array NumPy: the code the optimizers ran before they worked chunk by chunk (one
  thread, a temporary per step), for reference; for a 2-bit push, decoding it into a new
  array and adding that to the sum (against decoding it straight into the sum).

The variants alternate round by round (A B C A B C ...), and the table gives each one's median
and the ratio hetps / bare torch (under 1: hetps is faster). Timings on a shared machine are
noisy: compare the ratios of one run, not times across runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, median, print_table, write_json  # noqa: E402

from hetps import optim  # noqa: E402
from hetps.optim import kernels  # noqa: E402


def cases(n: int, torch):
    """(name, hetps step, bare torch step, whole-array numpy step or None) per case."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n, dtype=np.float32)
    g = (rng.standard_normal(n, dtype=np.float32) * 0.01).astype(np.float32)
    t = {name: torch.from_numpy(a) for name, a in (("w", w), ("g", g))}
    out = []

    # SGD with momentum
    sgd = optim.SGD(learning_rate=0.01, momentum=0.9)
    st = sgd.create_state("k", w)
    mom = torch.zeros(n)
    mom_np = np.zeros(n, np.float32)

    def sgd_np():
        gg = np.multiply(g, 1.0, dtype=np.float32)
        mom_np.__imul__(0.9)
        gg *= 0.01
        mom_np.__isub__(gg)
        np.add(w, mom_np, out=w)

    out.append(
        (
            "sgd momentum",
            lambda: sgd.apply_update("k", w, g, st, -1),
            lambda: (mom.mul_(0.9).add_(t["g"], alpha=-0.01), t["w"].add_(mom)),
            sgd_np,
        )
    )

    # plain SGD
    plain = optim.SGD(learning_rate=0.01)
    out.append(
        (
            "sgd",
            lambda: plain.apply_update("k", w, g, None, -1),
            lambda: t["w"].add_(t["g"], alpha=-0.01),
            None,
        )
    )

    # Adam
    adam = optim.Adam(learning_rate=1e-3)
    ast = adam.create_state("k", w)
    mean, var, denom = torch.zeros(n), torch.zeros(n), torch.empty(n)
    mean_np, var_np = np.zeros(n, np.float32), np.zeros(n, np.float32)
    steps = {"t": 0}

    def adam_torch():
        steps["t"] += 1
        k = steps["t"]
        lr_t = 1e-3 * math.sqrt(1 - 0.999**k) / (1 - 0.9**k)
        mean.mul_(0.9).add_(t["g"], alpha=0.1)
        var.mul_(0.999).addcmul_(t["g"], t["g"], value=0.001)
        torch.sqrt(var, out=denom).add_(1e-8)
        t["w"].addcdiv_(mean, denom, value=-lr_t)

    def adam_np():
        gg = np.multiply(g, 1.0, dtype=np.float32)
        mean_np.__imul__(0.9)
        mean_np.__iadd__(0.1 * gg)
        gg *= gg
        var_np.__imul__(0.999)
        var_np.__iadd__(0.001 * gg)
        np.sqrt(var_np, out=gg)
        gg += 1e-8
        np.divide(mean_np, gg, out=gg)
        gg *= -1e-3
        np.add(w, gg, out=w)

    out.append(("adam", lambda: adam.apply_update("k", w, g, ast, -1), adam_torch, adam_np))

    # DC-ASGD (a worker's push, compensated against its backup)
    dc = optim.DCASGD(learning_rate=0.01, lamda=0.04)
    dst = dc.create_state("k", w)
    dc.on_pull("k", w, dst, 1)
    bak, comp = torch.from_numpy(w.copy()), torch.empty(n)

    def dc_torch():
        torch.sub(t["w"], bak, out=comp).mul_(t["g"]).mul_(t["g"]).mul_(0.04).add_(t["g"])
        t["w"].add_(comp, alpha=-0.01)
        bak.copy_(t["w"])

    out.append(("dcasgd", lambda: dc.apply_update("k", w, g, dst, 1), dc_torch, None))

    # the server's merge of a second worker's push: sum = push1 + push2
    p1, p2, s = g.copy(), g.copy(), np.empty(n, np.float32)
    tp1, tp2, ts = torch.from_numpy(p1), torch.from_numpy(p2), torch.from_numpy(s)
    out.append(
        (
            "merge 2 pushes",
            lambda: kernels.add_into(s, p1, p2),
            lambda: torch.add(tp1, tp2, out=ts),
            lambda: np.add(p1, p2, out=s),
        )
    )
    # a 2-bit push added into the merge buffer: decoded straight into it, against decoding
    # into a new array and adding that (the server's way before)
    from hetps.kvstore.compression import TwoBitCompressor

    two_bit = TwoBitCompressor(0.5)
    words = two_bit.compress(g * 100, np.zeros(n, np.float32))
    acc = np.zeros(n, np.float32)
    out.append(
        (
            "2-bit push into the sum",
            lambda: two_bit.decompress(words, n, out=acc, add=True),
            None,
            lambda: acc.__iadd__(two_bit.decompress(words, n)),
        )
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elems", type=int, default=11_700_000, help="float32 values in the key")
    ap.add_argument("--rounds", type=int, default=15, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1M values, 3 rounds (CI)")
    ap.add_argument(
        "--threads", type=int, default=0, help="threads for both (0: the usable cores, at most 4)"
    )
    ap.add_argument("--json", default=None, help="write each case's medians (ms) here")
    args = ap.parse_args()
    if args.quick:
        args.elems, args.rounds, args.warmup = 1_000_000, 3, 1
    import torch

    n_threads = kernels.set_threads(args.threads)
    torch.set_num_threads(n_threads)
    info = machine_info()
    print(
        f"# server update on {args.elems:,} float32 values, {n_threads} threads "
        f"(hetps kernels and torch), {info['cores']} CPUs ({info['cpu']}), load {info['loadavg'][0]:.1f}, torch {torch.__version__}, "
        f"numpy {np.__version__}"
    )
    rows, results = [], []
    for name, ours, bare, whole in cases(args.elems, torch):
        variants = [("hetps", ours)] + ([("torch", bare)] if bare else [])
        variants += [("numpy", whole)] if whole else []
        times: dict[str, list[float]] = {v: [] for v, _ in variants}
        for r in range(args.warmup + args.rounds):
            for v, fn in variants:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if r >= args.warmup:
                    times[v].append(dt * 1e3)
        h = median(times["hetps"])
        b = median(times["torch"]) if bare else None
        w = median(times["numpy"]) if whole else None
        results.append({"case": name, "hetps_ms": h, "torch_ms": b, "numpy_ms": w,
                        "hetps_over_torch": None if b is None else h / b})  # fmt: skip
        rows.append(
            [
                name,
                f"{h:.1f}",
                "-" if b is None else f"{b:.1f}",
                "-" if b is None else f"{h / b:.2f}",
                "-" if w is None else f"{w:.1f}",
                "-" if w is None else f"{w / h:.2f}",
            ]
        )
    print_table(
        [
            "case",
            "hetps ms",
            "bare torch ms",
            "hetps/torch",
            "whole-array numpy ms",
            "numpy/hetps",
        ],
        rows,
    )
    if args.json:
        payload = {"machine": info, "elems": args.elems, "threads": n_threads, "cases": results}
        write_json(args.json, payload)


if __name__ == "__main__":
    main()
