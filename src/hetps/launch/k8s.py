"""``hetps k8s [options] -- CMD...``: a job's Kubernetes manifests
(:class:`~hetps.launch.k8s_manifests.K8sJob`, whose module says what each object holds)
written as YAML, to standard output or one file per object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import fields

from hetps.launch.contract import Flags, add_flags, after_dashes, env_pairs
from hetps.launch.k8s_manifests import K8sJob, ManifestError, parse_resources


# -- YAML ----------------------------------------------------------------------------------------
def to_yaml(objs: Sequence[dict]) -> str:
    """The objects as one multi-document YAML stream (``kubectl apply -f -`` reads it): each
    document in YAML's JSON form, which every YAML reader takes as it is."""
    return "".join(f"---\n{json.dumps(obj, indent=2, ensure_ascii=False)}\n" for obj in objs)


def write_dir(objs: Sequence[dict], out_dir: str) -> list[str]:
    """One file per object in ``out_dir`` (created), numbered in apply order; the Secret's
    file is mode 0600 and never overwritten. Returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, obj in enumerate(objs):
        name = f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path = os.path.join(out_dir, name)
        text = to_yaml([obj])
        if obj["kind"] == "Secret":
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise ManifestError(
                    f"{path} exists: a secret is never overwritten (a running job may use it); "
                    "remove it or write to another directory"
                ) from None
            with os.fdopen(fd, "w") as f:
                f.write(text)
        else:
            with open(path, "w") as f:
                f.write(text)
        paths.append(path)
    return paths


# -- the command ---------------------------------------------------------------------------------
# fmt: off
_K8S_FLAGS: Flags = (
    (("-n", "--num-workers"), dict(type=int, required=True)),
    (("-s", "--num-servers"), dict(type=int, default=None, help="default: = workers")),
    (("--image",), dict(required=True, help="an image with hetps and your code in it")),
    (("--name",), dict(default="hetps", help="prefix of every object (default hetps)")),
    (("--namespace",), dict(default="default")),
    (("--kind",), dict(choices=["jobset", "jobs"], default="jobset")),
    (("--port",), dict(type=int, default=9091, help="the scheduler's port (default 9091)")),
    (("--env",), dict(action="append", default=[], metavar="K=V")),
    (("--worker-resources",), dict(default="", metavar="cpu=2,memory=4Gi,...")),
    (("--server-resources",), dict(default="", metavar="cpu=1,memory=2Gi,...")),
    (("--scheduler-resources",), dict(default="", metavar="cpu=500m,memory=512Mi")),
    (("--secret-name",), dict(default=None,
        help="use this existing Secret (key 'secret') instead of writing a new one")),
    (("--connect-timeout",), dict(type=float, default=600.0, metavar="S")),
    (("--image-pull-policy",), dict(choices=["Always", "IfNotPresent", "Never"])),
    (("--service-account",), dict(default=None)),
    (("--metrics-port",), dict(type=int, default=9100,
        help="the scheduler's dashboard and Prometheus endpoint, with scrape annotations "
             "(default 9100)")),
    (("--no-metrics",), dict(action="store_true", help="no dashboard or metrics endpoint")),
    (("--run-as-user",), dict(type=int, default=1000,
        help="the pods' user id (not root; default 1000)")),
    (("-o", "--out-dir"), dict(default=None, help="write one file per object here")),
)
# fmt: on


def add_parser(sub) -> None:
    """``hetps k8s``."""
    k = sub.add_parser(
        "k8s",
        help="write Kubernetes manifests (JobSet, or Jobs + a headless Service) for a job",
        description="Write the manifests of a hetps job: a Secret with a fresh cluster secret, "
        "and a JobSet (--kind jobset, needs the JobSet controller) or plain Indexed Jobs plus a "
        "headless Service (--kind jobs). Apply with: hetps k8s ... | kubectl apply -f -  "
        "(docs/RAY_K8S.md)",
    )
    add_flags(k, _K8S_FLAGS)
    k.add_argument("command", nargs="*", help="the worker command (after --)")
    k.set_defaults(func=cmd_k8s)


def cmd_k8s(args) -> int:
    import sys

    try:
        job = K8sJob(
            **{f.name: getattr(args, f.name) for f in fields(K8sJob) if hasattr(args, f.name)}
            | {
                "command": after_dashes(args.command),
                "num_servers": args.num_workers if args.num_servers is None else args.num_servers,
                "env": env_pairs(args.env),
                "metrics_port": None if args.no_metrics else args.metrics_port,
            }
            | {
                f"{role}_resources": parse_resources(
                    getattr(args, f"{role}_resources"), f"--{role}-resources"
                )
                for role in ("worker", "server", "scheduler")
            }
        )
        objs = job.manifests()
        if args.out_dir:
            paths = write_dir(objs, args.out_dir)
            print(
                f"hetps k8s: wrote {len(paths)} manifests to {args.out_dir}; apply them with "
                f"kubectl apply -f {args.out_dir}",
                file=sys.stderr,
            )
        else:
            sys.stdout.write(to_yaml(objs))
        if job.secret_name is None:
            print(
                "hetps k8s: once applied, make the job own its Secret (deleted with it):\n  "
                + "\n  ".join(job.owner_commands()),
                file=sys.stderr,
            )
    except ValueError as exc:  # a ManifestError, or an --env item that is no NAME=VALUE
        print(f"hetps k8s: {exc}", file=sys.stderr)
        return 2
    return 0
