"""``hetps k8s [options] -- CMD...``: a job's Kubernetes manifests
(:class:`~hetps.launch.k8s_manifests.K8sJob`, whose module says what each object holds)
written as YAML, to standard output or one file per object.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

from hetps.launch.k8s_manifests import K8sJob, ManifestError, parse_resources

# -- YAML ----------------------------------------------------------------------------------------
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if v is None:
        return "null"
    return json.dumps(str(v), ensure_ascii=False)  # a JSON string is a YAML double-quoted one


def _key(k: str) -> str:
    return (
        k
        if _PLAIN_KEY.match(k) and k not in ("true", "false", "null", "yes", "no")
        else json.dumps(k)
    )


def _emit(v, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    if isinstance(v, dict):
        for k, x in v.items():
            if isinstance(x, (dict, list)) and x:
                lines.append(f"{pad}{_key(k)}:")
                _emit(x, indent + 1 if isinstance(x, dict) else indent, lines)
            else:
                lines.append(f"{pad}{_key(k)}: {_inline(x)}")
    elif isinstance(v, list):
        for x in v:
            if isinstance(x, dict) and x:
                sub: list[str] = []
                _emit(x, indent + 1, sub)
                first = sub[0][len(pad) + 2 :]
                lines.append(f"{pad}- {first}")
                lines.extend(sub[1:])
            elif isinstance(x, list) and x:
                raise ValueError("nested lists are not used in manifests")
            else:
                lines.append(f"{pad}- {_inline(x)}")
    else:
        lines.append(pad + _scalar(v))


def _inline(x) -> str:
    if isinstance(x, dict):
        return "{}"
    if isinstance(x, list):
        return "[]"
    return _scalar(x)


def to_yaml(objs: Sequence[dict]) -> str:
    """The objects as one multi-document YAML stream (``kubectl apply -f -`` reads it)."""
    docs = []
    for obj in objs:
        lines: list[str] = []
        _emit(obj, 0, lines)
        docs.append("\n".join(lines) + "\n")
    return "---\n" + "---\n".join(docs)


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
    k.add_argument("-n", "--num-workers", type=int, required=True)
    k.add_argument("-s", "--num-servers", type=int, default=None, help="default: = workers")
    k.add_argument("--image", required=True, help="an image with hetps and your code in it")
    k.add_argument("--name", default="hetps", help="prefix of every object (default hetps)")
    k.add_argument("--namespace", default="default")
    k.add_argument("--kind", choices=["jobset", "jobs"], default="jobset")
    k.add_argument("--port", type=int, default=9091, help="the scheduler's port (default 9091)")
    k.add_argument("--env", action="append", default=[], metavar="K=V")
    k.add_argument("--worker-resources", default="", metavar="cpu=2,memory=4Gi,...")
    k.add_argument("--server-resources", default="", metavar="cpu=1,memory=2Gi,...")
    k.add_argument("--scheduler-resources", default="", metavar="cpu=500m,memory=512Mi")
    k.add_argument(
        "--secret-name",
        default=None,
        help="use this existing Secret (key 'secret') instead of writing a new one",
    )
    k.add_argument("--connect-timeout", type=float, default=600.0, metavar="S")
    k.add_argument("--image-pull-policy", choices=["Always", "IfNotPresent", "Never"])
    k.add_argument("--service-account", default=None)
    k.add_argument(
        "--metrics-port",
        type=int,
        default=9100,
        help="the scheduler's dashboard and Prometheus endpoint, with scrape annotations "
        "(default 9100)",
    )
    k.add_argument("--no-metrics", action="store_true", help="no dashboard or metrics endpoint")
    k.add_argument(
        "--run-as-user", type=int, default=1000, help="the pods' user id (not root; default 1000)"
    )
    k.add_argument("-o", "--out-dir", default=None, help="write one file per object here")
    k.add_argument("command", nargs="*", help="the worker command (after --)")
    k.set_defaults(func=cmd_k8s)


def cmd_k8s(args) -> int:
    import sys

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    env = {}
    try:
        for item in args.env:
            if "=" not in item or item.startswith("="):
                raise ManifestError(f"--env {item!r} must look like NAME=VALUE")
            key, value = item.split("=", 1)
            env[key] = value
        job = K8sJob(
            name=args.name,
            image=args.image,
            command=command,
            num_workers=args.num_workers,
            num_servers=args.num_servers if args.num_servers is not None else args.num_workers,
            namespace=args.namespace,
            kind=args.kind,
            port=args.port,
            env=env,
            worker_resources=parse_resources(args.worker_resources, "--worker-resources"),
            server_resources=parse_resources(args.server_resources, "--server-resources"),
            scheduler_resources=parse_resources(args.scheduler_resources, "--scheduler-resources"),
            secret_name=args.secret_name,
            connect_timeout=args.connect_timeout,
            image_pull_policy=args.image_pull_policy,
            service_account=args.service_account,
            metrics_port=None if args.no_metrics else args.metrics_port,
            run_as_user=args.run_as_user,
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
    except ManifestError as exc:
        print(f"hetps k8s: {exc}", file=sys.stderr)
        return 2
    return 0
