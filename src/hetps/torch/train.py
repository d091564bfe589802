"""``hetps train``: Fashion-MNIST on a hetps cluster with SSGD, ASGD, DC-ASGD, ESync or locally.

Flags follow ESync's (``-m esync|sync|async|local``, ``-n`` network, ``-l``/``-ll``/``-gl``
learning rates, ``-b``, ``-dd``, ``-ld``, ``-e``, ``-dcasgd``, ``-s``, ``-ip``/``-port``).
Started under a launcher (``DMLC_ROLE=worker``) it is one worker; with ``--workers W`` it
starts a whole local cluster itself. ``--slowdown 1,1,2,4`` makes worker k that many times
slower than its real compute (it sleeps the extra time), an *emulated* heterogeneous cluster.

Every worker writes one JSON line per iteration (see docs/METRICS.md) into
``LOG_DIR/RUN_NAME/``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from hetps.config import env_value, role_from_env

MODES = ("esync", "sync", "async", "local")


# -- argument parsing -------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``hetps train`` (ESync's names where ESync has them)."""
    p.add_argument("-m", "--mode", choices=MODES, default="esync")
    p.add_argument("-n", "--network", default="mlp", help="model name (hetps models lists them)")
    p.add_argument("-l", "--learning-rate", type=float, default=0.05, help="sync/async/local lr")
    p.add_argument("-ll", "--local-lr", type=float, default=0.05, help="ESync local step lr")
    p.add_argument("-gl", "--global-lr", type=float, default=1.0, help="ESync global lr")
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument("-dd", "--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("-c", "--cpu", action="store_true", help="train on the CPU (default)")
    p.add_argument("-g", "--gpu", type=int, default=None, help="CUDA device index")
    p.add_argument("-ld", "--log-dir", default="runs")
    p.add_argument("--run-name", default=None, help="default: MODE-NETWORK-wW")
    p.add_argument("-e", "--eval-duration", type=int, default=10, help="evaluate every E rounds")
    p.add_argument("-dcasgd", "--use-dcasgd", type=int, default=0, choices=(0, 1))
    p.add_argument("-s", "--split-by-class", action="store_true")
    p.add_argument("-ip", "--state-server-ip", default=None)
    p.add_argument("-port", "--state-server-port", type=int, default=None)
    p.add_argument("--workers", type=int, default=None, help="start a local cluster of W workers")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--slowdown", default=None, help="per-worker factors, e.g. 1,1,2,4")
    p.add_argument(
        "--devices",
        default=None,
        help="per-worker device, e.g. gpu:0,cpu,cpu,cpu (a real heterogeneous cluster on one "
        "machine; instead of -g/-c)",
    )
    p.add_argument("--time-budget", type=float, default=None, help="stop after SECONDS")
    p.add_argument("--epochs", type=float, default=None, help="stop after EPOCHS of rank 0's shard")
    p.add_argument("--max-rounds", type=int, default=None)
    p.add_argument("--train-limit", type=int, default=None, help="use the first N training images")
    p.add_argument(
        "--test-limit", type=int, default=2000, help="evaluate on the first N test images"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto")


def parse_slowdown(text: str | None, workers: int) -> list[float]:
    """``"1,1,2,4"`` -> factors per worker (all 1.0 when not given)."""
    if not text:
        return [1.0] * workers
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"hetps train: --slowdown {text!r} must be numbers like 1,1,2,4") from None
    if len(vals) != workers or any(v < 1 for v in vals):
        raise SystemExit(
            f"hetps train: --slowdown needs {workers} factors >= 1 (one per worker), got {text!r}"
        )
    return vals


def parse_devices(args: argparse.Namespace, workers: int) -> list[str]:
    """The torch device of every worker: ``--devices gpu:0,cpu`` (``cpu``, ``gpu:N`` or
    ``cuda:N`` per worker), else ``-g N`` for all (``-c`` wins), else ``cpu`` for all."""
    text = getattr(args, "devices", None)
    if not text:
        dev = "cpu" if args.gpu is None or args.cpu else f"cuda:{args.gpu}"
        return [dev] * workers
    if args.gpu is not None or args.cpu:
        raise SystemExit(
            "hetps train: --devices names every worker's device; drop -g/-c (or drop --devices)"
        )
    out: list[str] = []
    for item in (v.strip().lower() for v in text.split(",")):
        kind, _, idx = item.partition(":")
        if item == "cpu":
            out.append("cpu")
        elif kind in ("gpu", "cuda") and idx.isdigit():
            out.append(f"cuda:{int(idx)}")
        else:
            raise SystemExit(
                f"hetps train: --devices {text!r}: {item!r} is not a device; give cpu, gpu:N "
                "or cuda:N per worker, e.g. gpu:0,cpu,cpu"
            )
    if len(out) != workers:
        raise SystemExit(
            f"hetps train: --devices needs {workers} entries (one per worker), got {len(out)} "
            f"in {text!r}"
        )
    return out


def stored_mode(args: argparse.Namespace) -> str:
    """The mode as logs name it (async with DC-ASGD is 'dcasgd')."""
    return "dcasgd" if args.mode == "async" and args.use_dcasgd else args.mode


def run_name(args: argparse.Namespace, workers: int) -> str:
    """The run directory's name."""
    return args.run_name or f"{stored_mode(args)}-{args.network}-w{workers}"


# -- entry ------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    """``hetps train``: one worker under a launcher, a whole local cluster, or local training."""
    role = role_from_env()
    if args.mode == "local":
        return train_worker(args, kv=None)
    if role in ("server", "scheduler"):
        import hetps.kv

        hetps.kv.create("dist_async" if args.mode == "async" else "dist_sync")  # serves, exits
        return 0
    if role == "worker":
        import hetps.kv

        kv = hetps.kv.create("dist_async" if args.mode == "async" else "dist_sync")
        try:
            return train_worker(args, kv)
        finally:
            kv.close()
    if not args.workers:
        raise SystemExit(
            "hetps train: give --workers W (and --servers S) to start a local cluster, run it "
            "under `hetps launch`, or use -m local"
        )
    return launch_cluster(args)


def launch_cluster(args: argparse.Namespace) -> int:
    """Start scheduler, servers and W workers running this same command as workers."""
    from hetps.launch.local import LaunchSpec, run_cluster

    parse_slowdown(args.slowdown, args.workers)  # fail early
    parse_devices(args, args.workers)
    argv = [a for a in sys.argv[1:]]
    # drop --workers/--servers (and their values) from the worker command line
    cleaned: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--workers", "--servers", "--netem", "--balance", "--slice-size"):
            skip = True
            continue
        if a.startswith(("--workers=", "--servers=", "--netem=", "--balance=", "--slice-size=")):
            continue
        if a == "--colocate":
            continue
        cleaned.append(a)
    cmd = [sys.executable, "-m", "hetps.cli", *cleaned]
    spec = LaunchSpec(
        num_workers=args.workers,
        num_servers=args.servers,
        command=cmd,
        env={"OMP_NUM_THREADS": str(env_value("OMP_NUM_THREADS"))},
    )
    return run_cluster(
        spec,
        netem=args.netem,
        colocate=args.colocate,
        balance=args.balance,
        slice_elems=args.slice_size,
    )


# -- helpers ----------------------------------------------------------------------------------
class _Clock:
    """Phase timers of one iteration."""

    def __init__(self) -> None:
        self.phases = {"compute_s": 0.0, "push_s": 0.0, "pull_s": 0.0, "wait_s": 0.0}

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] += seconds


def _evaluate(model: Any, images: Any, labels: Any, batch: int = 500) -> float:
    import torch

    from hetps.torch.data import normalize

    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(labels), batch):
            x = normalize(images[i : i + batch])  # [B, 1, 28, 28]
            dev = next(model.parameters()).device
            pred = model(x.to(dev)).argmax(1).cpu()
            correct += int((pred == torch.from_numpy(labels[i : i + batch])).sum())
    model.train()
    return correct / max(1, len(labels))


class _Progress:
    """A progress bar in a terminal, plain lines otherwise."""

    def __init__(self, mode: str, rank: int, total: float | None) -> None:
        self.bar = mode == "bar" or (mode == "auto" and sys.stdout.isatty())
        self.rank = rank
        self.total = total
        self.last_line = 0.0

    def update(self, it: int, sps: float, loss: float, acc: float | None, elapsed: float) -> None:
        acc_s = f"{acc:.4f}" if acc is not None else "-"
        if self.bar:
            frac = min(1.0, elapsed / self.total) if self.total else 0.0
            filled = int(frac * 20)
            sys.stdout.write(
                f"\r[worker {self.rank}] [{'#' * filled}{'.' * (20 - filled)}] it {it} "
                f"{sps:8.1f} samples/s loss {loss:.4f} acc {acc_s}"
            )
            sys.stdout.flush()
        elif time.monotonic() - self.last_line > 2.0 or acc is not None:
            print(
                f"worker {self.rank} iter {it} {sps:.1f} samples/s loss {loss:.4f} acc {acc_s} "
                f"t {elapsed:.1f}s",
                flush=True,
            )
            self.last_line = time.monotonic()

    def close(self) -> None:
        if self.bar:
            sys.stdout.write("\n")


# -- the training loop ----------------------------------------------------------------------
class _FlatExchange:
    """Tensors that travel together: one flat CPU tensor (and KVStore key) per dtype, each
    tensor a view into it. Initial values are copied in."""

    def __init__(self, entries: list[tuple[str, Any]]) -> None:
        import torch

        by_dtype: dict[Any, list[tuple[str, Any]]] = {}
        for name, t in entries:
            by_dtype.setdefault(t.dtype, []).append((name, t))
        self.keys: list[str] = []
        self.flats: list[Any] = []
        self._views: dict[str, Any] = {}
        for dtype, items in by_dtype.items():
            flat = torch.empty(sum(t.numel() for _, t in items), dtype=dtype)
            off = 0
            for name, t in items:
                view = flat[off : off + t.numel()].view(t.shape)
                view.copy_(t)
                self._views[name] = view
                off += t.numel()
            self.keys.append(f"round:{str(dtype).removeprefix('torch.')}")
            self.flats.append(flat)

    def view(self, name: str) -> Any:
        return self._views[name]


def train_worker(args: argparse.Namespace, kv: Any) -> int:  # noqa: C901 - one loop, all modes
    """Train as one worker (or alone, for ``-m local``); returns 0."""
    import numpy as np
    import torch

    from hetps import optim as ps_optim
    from hetps.metrics.records import IterationLog, RunWriter
    from hetps.metrics.traffic import TrafficRecorder
    from hetps.torch.data import batches, load_fashion_mnist, partition
    from hetps.torch.models import get_model
    from hetps.torch.optimizer import DistributedOptimizer

    torch.set_num_threads(env_value("OMP_NUM_THREADS") or 1)
    rank = kv.rank if kv is not None else 0
    workers = kv.num_workers if kv is not None else 1
    devices = parse_devices(args, workers)
    device = torch.device(devices[rank])
    if device.type == "cuda" and (
        not torch.cuda.is_available() or device.index >= torch.cuda.device_count()
    ):
        flag = "--devices" if args.devices else "-g"
        raise SystemExit(
            f"hetps train: {flag}: worker {rank} wants {device}, but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s); train on the CPU instead (cpu)"
        )
    slow = parse_slowdown(args.slowdown, workers)[rank]
    mode = stored_mode(args)

    images, labels = load_fashion_mnist(args.data_dir, train=True, limit=args.train_limit)
    test_x, test_y = load_fashion_mnist(args.data_dir, train=False, limit=args.test_limit)
    shard = partition(labels, workers, rank, split_by_class=args.split_by_class, seed=args.seed)
    torch.manual_seed(args.seed)
    model = get_model(args.network).to(device)
    model.train()

    run_dir = Path(args.log_dir) / run_name(args, workers)
    writer = None
    if rank == 0:
        writer = RunWriter(
            run_dir,
            overwrite=True,
            meta={
                "mode": mode,
                "network": args.network,
                "workers": workers,
                "servers": args.servers if kv is not None else 0,
                "batch_size": args.batch_size,
                "slowdown": parse_slowdown(args.slowdown, workers),
                "split_by_class": bool(args.split_by_class),
                "started_at": time.time(),
                "devices": {
                    str(r): f"worker{r} ({d}" + (f", slowdown x{s:g})" if s != 1 else ")")
                    for r, (s, d) in enumerate(
                        zip(parse_slowdown(args.slowdown, workers), devices, strict=True)
                    )
                },
                "learning_rate": args.learning_rate,
                "local_lr": args.local_lr,
                "global_lr": args.global_lr,
                "scheme": kv.cfg.balance if kv is not None and kv.cfg.balance != "none" else None,
                "slice_size": kv.cfg.slice_elems
                if kv is not None and kv.cfg.balance != "none"
                else None,
                "scenario": env_value("HETPS_NETEM_SCENARIO"),
                "emulated_heterogeneity": any(
                    s != 1 for s in parse_slowdown(args.slowdown, workers)
                ),
            },
        )
    else:
        run_dir.mkdir(parents=True, exist_ok=True)

    params = [(n, p) for n, p in model.named_parameters()]
    float_buffers = [(n, b) for n, b in model.named_buffers() if b.dtype.is_floating_point]

    dopt = None
    local_opt = None
    if kv is None:
        local_opt = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    elif args.mode == "sync":
        stop_flag = torch.zeros(1, dtype=torch.float32)  # summed over the workers each step
        dopt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.learning_rate),
            params,
            kvstore=kv,
            op="average",
            extra=stop_flag,
        )
    elif args.mode == "async":
        server_opt = (
            ps_optim.DCASGD(learning_rate=args.learning_rate, lamda=0.04)
            if args.use_dcasgd
            else ps_optim.SGD(learning_rate=args.learning_rate)
        )
        dopt = DistributedOptimizer(
            None, params, kvstore=kv, update_on="server", server_optimizer=server_opt
        )
    else:  # esync
        dopt = None
        local_opt = torch.optim.SGD(model.parameters(), lr=args.local_lr)
        init = [f"init:{n}" for n, _ in params]
        staged = [p.data.detach().cpu().clone() for _, p in params]  # CPU side of the KVStore
        kv.init(init, staged)
        kv.pull(init, out=staged)
        with torch.no_grad():
            for (_, p), t in zip(params, staged, strict=True):
                p.data.copy_(t)
        # a round's model difference, BatchNorm statistics and stop flag travel as one flat
        # key per dtype (one request per chunk instead of one per tensor), each tensor a view
        exchange = _FlatExchange(
            [(f"delta:{n}", t) for (n, _), t in zip(params, staged, strict=True)]
            + [(f"bn:{n}", b.detach().cpu()) for n, b in float_buffers]
            + [("__ctl", torch.zeros(1, dtype=torch.float32))]
        )
        kv.init(exchange.keys, exchange.flats)
        deltas = {n: exchange.view(f"delta:{n}") for n, _ in params}
        bn_cpu = {n: exchange.view(f"bn:{n}") for n, _ in float_buffers}
        esync_ctl = exchange.view("__ctl")
        from hetps.cluster.state_server import StateClient

        endpoint = (
            f"{args.state_server_ip}:{args.state_server_port}"
            if args.state_server_ip and args.state_server_port
            else None
        )
        state = StateClient(kv.node, endpoint)
    if kv is not None:
        kv.init("__ctl", np.zeros(1, np.float32))

    traffic = None
    run_start = time.time()
    if kv is not None:
        kv.barrier()
        run_start = time.time()
        traffic = TrafficRecorder(run_start)
    if writer is not None:
        writer.update(started_at=run_start)
    if kv is not None:

        def observe(direction: str, peer: Any, cmd: str, nbytes: int, ts: float) -> None:
            if direction == "send" and cmd == "push":
                traffic.record(ts, peer, "push", nbytes)
            elif direction == "recv" and cmd == "pull":
                traffic.record(ts, peer, "pull", nbytes)

        kv.node.van.observer = observe

    log = IterationLog(run_dir, rank)
    progress = _Progress(args.progress, rank, args.time_budget)
    loss_fn = torch.nn.CrossEntropyLoss()
    per_epoch = max(1, len(shard) // args.batch_size)

    def data_stream():
        for epoch in itertools.count():
            for x, y in batches(
                images,
                labels,
                shard,
                args.batch_size,
                seed=args.seed + rank,
                epoch=epoch,
                drop_last=True,
            ):
                yield epoch, x, y

    stream = data_stream()
    computes: list[float] = []  # recent real compute times of one step
    steps_done = 0
    last_compute = 0.0
    acc: float | None = None

    def one_step(opt_step) -> tuple[float, float, int, int]:
        """Forward, emulated slowdown, backward, optimizer step; (loss, compute s, samples)."""
        nonlocal steps_done, last_compute
        epoch, x, y = next(stream)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t0 = time.perf_counter()
        out = model(x)
        loss = loss_fn(out, y)
        slept = 0.0
        if slow > 1 and computes:
            # emulated slower device (--slowdown): sleep (factor - 1) x the median of recent
            # real compute times, and count what was actually slept, so one hiccup is not
            # multiplied into the next sleep
            want = sorted(computes)[len(computes) // 2] * (slow - 1)
            ts = time.perf_counter()
            time.sleep(want)
            slept = time.perf_counter() - ts
        if dopt is not None:
            dopt.zero_grad()
        else:
            local_opt.zero_grad()
        loss.backward()
        opt_step()
        dt = time.perf_counter() - t0
        real = max(dt - slept, 1e-6)
        computes.append(real)
        del computes[:-9]
        last_compute = real
        steps_done += 1
        return float(loss.detach()), (dt if slow > 1 else real), len(y), epoch

    rnd = 0
    stop = False
    while not stop:
        rnd += 1
        clock = _Clock()
        t_iter = time.perf_counter()
        sent0, recv0 = kv.node.van.counters.totals() if kv is not None else (0, 0)
        samples = 0
        losses = []
        local_steps = 0
        ctl_handle = None
        plan = None
        overhead = 0.0
        if kv is not None and args.mode != "async" and kv.balance:
            t0 = time.perf_counter()
            plan = kv.rebalance()  # report link measurements, switch to this round's plan
            overhead = time.perf_counter() - t0
        if args.mode == "esync":
            w_round = [p.data.clone() for _, p in params]
            t_round = time.perf_counter()
            deadline = None  # the round's deadline on this clock, once the state server told
            pending = []  # reports sent without waiting
            while True:
                loss, c, n, epoch = one_step(local_opt.step)
                clock.add("compute_s", c)
                samples += n
                losses.append(loss)
                local_steps += 1
                t0 = time.perf_counter()
                if deadline is None:  # the first step of the round: wait for the answer
                    ans = state.report(rnd, c, t0 - t_round)
                    clock.add("wait_s", time.perf_counter() - t0)
                    if "error" in ans:
                        raise RuntimeError(ans["error"])
                    if ans.get("ready"):
                        break
                    if isinstance(ans.get("deadline_in_s"), (int, float)):
                        deadline = time.perf_counter() + float(ans["deadline_in_s"])
                    continue
                # later steps: report without waiting (the server keeps every estimate), and
                # stop at the deadline or when an answer that came in says ready
                pending.append(state.report_nowait(rnd, c, t0 - t_round))
                done = [f for f in pending if f.done()]
                pending = [f for f in pending if f not in done]
                answers = [f.wait(0).body for f in done]
                if any("error" in a for a in answers):
                    raise RuntimeError(next(a["error"] for a in answers if "error" in a))
                if any(a.get("ready") for a in answers) or time.perf_counter() + c > deadline:
                    break
        else:
            ctl_handle = None
            if kv is not None and args.mode == "sync":
                # "stop after this round?" travels with the gradients, not in a round of its own
                pre_stop = (
                    (args.time_budget is not None and time.time() - run_start >= args.time_budget)
                    or (args.epochs is not None and (steps_done + 1) / per_epoch >= args.epochs)
                    or (args.max_rounds is not None and rnd >= args.max_rounds)
                )
                ctl = np.array([1.0 if pre_stop else 0.0], np.float32)
                if dopt is not None and dopt.extra_rides:
                    dopt.extra.fill_(ctl[0])  # rides with the gradients, summed by step()
                else:
                    ctl_handle = kv.pushpull("__ctl", ctl, block=False)
            if dopt is not None and args.mode in ("sync", "async"):
                t0 = time.perf_counter()
                loss, c, n, epoch = one_step(lambda: None)
                # the hooks pushed during backward; step() waits for the pulls
                t1 = time.perf_counter()
                dopt.step()
                clock.add("wait_s", time.perf_counter() - t1)
                clock.add("compute_s", c)
            else:
                loss, c, n, epoch = one_step(local_opt.step)
                clock.add("compute_s", c)
            samples += n
            losses.append(loss)
            local_steps = 1

        elapsed = time.time() - run_start
        want_stop = (
            (args.time_budget is not None and elapsed >= args.time_budget)
            or (args.epochs is not None and steps_done / per_epoch >= args.epochs)
            or (args.max_rounds is not None and rnd >= args.max_rounds)
        )
        if args.mode == "esync":
            t0 = time.perf_counter()
            for (n, p), w0 in zip(params, w_round, strict=True):
                deltas[n].copy_(p.data - w0)
            for n, b in float_buffers:
                bn_cpu[n].copy_(b)
            esync_ctl.fill_(1.0 if want_stop else 0.0)
            kv.pushpull(exchange.keys, exchange.flats)  # the sums land in place
            clock.add("push_s", time.perf_counter() - t0)
            with torch.no_grad():
                for (n, p), w0 in zip(params, w_round, strict=True):
                    p.data.copy_(w0 + args.global_lr * deltas[n].to(p.device) / workers)
                for n, b in float_buffers:
                    b.copy_(bn_cpu[n] / workers)
            stop = bool(esync_ctl[0] > 0)
        elif ctl_handle is not None:
            ctl_handle.wait()
            stop = bool(ctl[0] > 0)
        elif args.mode == "sync" and dopt is not None and dopt.extra_rides:
            stop = bool(dopt.extra[0] > 0)  # summed over the workers by dopt.step()
        else:
            stop = want_stop  # async and local: each worker stops on its own

        dur = time.perf_counter() - t_iter  # the round itself, without evaluation
        eval_s = 0.0
        if rank == 0 and (rnd % max(1, args.eval_duration) == 0 or stop):
            te = time.perf_counter()
            acc = _evaluate(model, test_x, test_y)
            eval_s = time.perf_counter() - te
        else:
            acc = None
        sent1, recv1 = kv.node.van.counters.totals() if kv is not None else (0, 0)
        rec = {
            "rank": rank,
            "iter": rnd,
            "epoch": int(epoch),
            "t": time.time() - run_start,
            "samples": samples,
            "loss": float(np.mean(losses)),
            "local_steps": local_steps,
            **clock.phases,
            "bytes_sent": sent1 - sent0,
            "bytes_recv": recv1 - recv0,
            "srit_s": dur,
            "eval_s": eval_s,
            "comm_s": clock.phases["push_s"] + clock.phases["pull_s"] + clock.phases["wait_s"],
        }
        if plan is not None:
            rec.update(
                overhead_s=overhead,
                plan=plan["shares"],
                plan_epoch=plan["epoch"],
                link_matrix=plan["link_matrix"],
                # new probe cycles the planner asked for so far (docs/BALANCE.md §7.3)
                recalibrations=plan.get("recalibrations", 0),
            )
        if acc is not None:
            rec["accuracy"] = acc
        log.write(rec)
        progress.update(rnd, samples / max(dur, 1e-9), rec["loss"], acc, rec["t"])

    progress.close()
    log.close()
    if traffic is not None:
        kv.node.van.observer = None
        role = "worker"
        traffic.write(run_dir / f"traffic-{role}{rank}.jsonl")
    if dopt is not None:
        dopt.close()
    if kv is not None:
        kv.barrier() if args.mode != "async" else None
    print(
        f"worker {rank} finished {rnd} rounds ({steps_done} local steps) in "
        f"{time.time() - run_start:.1f}s; logs in {run_dir}",
        flush=True,
    )
    return 0
