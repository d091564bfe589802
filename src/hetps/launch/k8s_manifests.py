"""Kubernetes manifests for a hetps job (:class:`K8sJob`), as ``hetps k8s`` writes them
(:mod:`hetps.launch.k8s`); docs/RAY_K8S.md says what each object holds and why.
(docs/MODULES.md, "hetps.launch.k8s_manifests")"""

from __future__ import annotations

import base64
import json
import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetps.launch.contract import HOST_VARS

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
#: the annotation a Job puts on each of its pods with the pod's completion index
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
SECRET_KEY = "secret"
ROLES = ("scheduler", "server", "worker")
#: names hetps sets in every pod; --env may not override them
RESERVED_ENV = (
    "DMLC_ROLE",
    "DMLC_PS_ROOT_URI",
    "DMLC_PS_ROOT_PORT",
    "DMLC_NUM_SERVER",
    "DMLC_NUM_WORKER",
    "DMLC_NODE_HOST",
    "HETPS_LAUNCH_RANK",
    "HETPS_SECRET",
    "HETPS_SECRET_FILE",
    *HOST_VARS,
)
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")
_RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
#: a JobSet pod's name is NAME-ROLE-0-INDEX-xxxxx and must fit 63 characters
MAX_NAME = 40


class ManifestError(ValueError):
    """A bad option of ``hetps k8s``; the message names it and the fix."""


def parse_resources(text: str, flag: str) -> dict[str, str]:
    """``cpu=2,memory=4Gi,nvidia.com/gpu=1`` -> a dict, each quantity checked."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, qty = item.partition("=")
        name, qty = name.strip(), qty.strip()
        if not sep or not name or not qty:
            raise ManifestError(
                f"{flag} {text!r}: each item must look like NAME=QUANTITY, e.g. cpu=2,memory=4Gi"
            )
        if not _RESOURCE_NAME.match(name):
            raise ManifestError(
                f"{flag}: {name!r} is not a resource name (cpu, memory, nvidia.com/gpu)"
            )
        if not _QUANTITY.match(qty):
            raise ManifestError(
                f"{flag}: {name}={qty!r} is not a Kubernetes quantity: use e.g. 2, 500m, 4Gi"
            )
        out[name] = qty
    return out


def _cpu_count(qty: str) -> int | None:
    """Whole CPUs of a cpu quantity (``2`` -> 2, ``1500m`` -> 2, ``500m`` -> 1)."""
    m = _QUANTITY.match(qty)
    if not m:
        return None
    value = float(m.group(1))
    suffix = m.group(2) or ""
    if suffix == "m":
        value /= 1000
    elif suffix:
        return None
    return max(1, math.ceil(value))


@dataclass
class K8sJob:
    """What ``hetps k8s`` writes manifests for."""

    name: str
    image: str
    command: list[str]
    num_workers: int
    num_servers: int
    namespace: str = "default"
    kind: str = "jobset"  # or "jobs"
    port: int = 9091
    env: dict[str, str] = field(default_factory=dict)
    worker_resources: dict[str, str] = field(default_factory=dict)
    server_resources: dict[str, str] = field(default_factory=dict)
    scheduler_resources: dict[str, str] = field(default_factory=dict)
    secret_name: str | None = None  # an existing Secret (key "secret"); None: make one
    connect_timeout: float = 600.0
    image_pull_policy: str | None = None
    service_account: str | None = None
    hetps: Sequence[str] = ("hetps",)  # how the image runs hetps' own commands
    metrics_port: int | None = 9100  # the scheduler's dashboard and /metrics (None: off)
    run_as_user: int = 1000  # pods run as this user (never root: "restricted" pods)

    def check(self) -> None:
        """Raise ManifestError naming the first bad option and its fix."""
        metrics = self.metrics_port
        for bad, text in (
            (not self.image, "--image is required: an image with hetps and your code in it"),
            (not self.command, "give the worker command after --, e.g. hetps k8s -n 2 --image "
                "IMG -- python train.py"),
            (not _DNS_LABEL.match(self.name) or len(self.name) > MAX_NAME,
                f"--name {self.name!r}: use lowercase letters, digits and '-', starting with a "
                f"letter, at most {MAX_NAME} characters (it prefixes every object and pod name)"),
            (not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63,
                f"--namespace {self.namespace!r} is not a namespace name"),
            (self.kind not in ("jobset", "jobs"), f"--kind {self.kind!r}: use jobset or jobs"),
            (self.num_workers < 1, "-n/--num-workers must be >= 1"),
            (self.num_servers < 1, "-s/--num-servers must be >= 1"),
            (not 1 <= self.port <= 65535, f"--port {self.port}: use a TCP port from 1 to 65535"),
            (metrics is not None and not (1 <= metrics <= 65535 and metrics != self.port),
                f"--metrics-port {metrics}: use a TCP port from 1 to 65535 other than --port, "
                "or --no-metrics"),
            (not 1 <= self.run_as_user <= 2**31 - 1, f"--run-as-user {self.run_as_user}: pods "
                "run as a user other than root (1 or more)"),
            (self.connect_timeout <= 0, "--connect-timeout must be > 0 seconds"),
            (self.secret_name is not None and not _DNS_SUBDOMAIN.match(self.secret_name),
                f"--secret-name {self.secret_name!r} is not a Secret name"),
        ):  # fmt: skip
            if bad:
                raise ManifestError(text)
        for k in self.env:
            if k in RESERVED_ENV:
                how = (
                    "the cluster secret goes in a Kubernetes Secret (--secret-name, or leave it "
                    "out and hetps k8s makes one)"
                    if k.startswith("HETPS_SECRET")
                    else "hetps k8s sets it for every pod"
                )
                raise ManifestError(f"--env {k}=...: {how}")
            if not _ENV_NAME.match(k):
                raise ManifestError(f"--env {k!r} is not an environment variable name")

    # -- names ------------------------------------------------------------------------------
    @property
    def subdomain(self) -> str:
        return self.name

    def job_name(self, role: str) -> str:
        """The Job of ``role`` (JobSet: replicated job ROLE, job index 0)."""
        return f"{self.name}-{role}-0" if self.kind == "jobset" else f"{self.name}-{role}"

    def pod_host(self, role: str, index: int) -> str:
        """The DNS name of pod ``index`` of ``role`` inside the namespace."""
        if self.kind == "jobset":
            return f"{self.name}-{role}-0-{index}.{self.subdomain}"
        return f"{self.name}-{role}-{index}.{self.subdomain}"

    @property
    def scheduler_host(self) -> str:
        return self.pod_host("scheduler", 0)

    @property
    def secret_ref(self) -> str:
        return self.secret_name or f"{self.name}-secret"

    @property
    def ports(self) -> list[tuple[str, int]]:
        """The scheduler's ports, by name (its own, and the metrics endpoint's unless off)."""
        metrics = [] if self.metrics_port is None else [("metrics", self.metrics_port)]
        return [("scheduler", self.port), *metrics]

    def labels(self, role: str | None = None) -> dict[str, str]:
        out = {"app.kubernetes.io/name": "hetps", "hetps.io/job": self.name}
        if role:
            out["hetps.io/role"] = role
        return out

    # -- pods -------------------------------------------------------------------------------
    def env_for(self, role: str) -> list[dict]:
        """The container environment of ``role``'s pods."""
        env = [
            {"name": "DMLC_ROLE", "value": role},
            {"name": "DMLC_PS_ROOT_URI", "value": self.scheduler_host},
            {"name": "DMLC_PS_ROOT_PORT", "value": str(self.port)},
            {"name": "DMLC_NUM_SERVER", "value": str(self.num_servers)},
            {"name": "DMLC_NUM_WORKER", "value": str(self.num_workers)},
            {"name": "DMLC_NODE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ]
        index = {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}
        if role != "scheduler":
            env.append({"name": "HETPS_LAUNCH_RANK", "valueFrom": index})
        if role == "worker":  # a pod is a host of one worker (docs/MODULES.md)
            for name in ("RANK", "GROUP_RANK", "HETPS_HOST_GROUP"):
                env.append({"name": name, "valueFrom": index})
            env += [
                {"name": "WORLD_SIZE", "value": str(self.num_workers)},
                {"name": "LOCAL_RANK", "value": "0"},
                {"name": "LOCAL_WORLD_SIZE", "value": "1"},
            ]
        env.append(
            {
                "name": "HETPS_SECRET",
                "valueFrom": {"secretKeyRef": {"name": self.secret_ref, "key": SECRET_KEY}},
            }
        )
        env.append({"name": "HETPS_CONNECT_TIMEOUT", "value": f"{self.connect_timeout:g}"})
        if role == "scheduler" and self.metrics_port is not None:
            # the endpoint binds the scheduler's own address (its pod's DNS name), by name
            env.append({"name": "HETPS_METRICS_PORT", "value": str(self.metrics_port)})
            env.append({"name": "HETPS_METRICS_HOST", "value": self.scheduler_host})
        env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
        cpu = self.worker_resources.get("cpu")
        threads = 1 if role != "worker" else _cpu_count(cpu) if cpu else None
        if "OMP_NUM_THREADS" not in self.env and threads is not None:
            env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
        env += [{"name": k, "value": v} for k, v in self.env.items()]
        return env

    def container(self, role: str) -> dict:
        command = list(self.command) if role == "worker" else [*self.hetps, role]
        c: dict = {"name": role, "image": self.image, "command": command, "env": self.env_for(role)}
        if self.image_pull_policy:
            c["imagePullPolicy"] = self.image_pull_policy
        res = getattr(self, f"{role}_resources")
        if res:
            c["resources"] = {"requests": dict(res), "limits": dict(res)}
        if role == "scheduler":
            c["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in self.ports]
        # the "restricted" Pod Security Standard: no root, no privilege escalation, no
        # capabilities, the runtime's default seccomp profile
        c["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        return c

    def pod_template(self, role: str) -> dict:
        spec: dict = {
            "restartPolicy": "Never",
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": self.run_as_user,
                "runAsGroup": self.run_as_user,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [self.container(role)],
        }
        if self.kind == "jobs":
            spec["subdomain"] = self.subdomain  # hostname JOB-INDEX comes with Indexed Jobs
        if self.service_account:
            spec["serviceAccountName"] = self.service_account
        meta: dict = {"labels": self.labels(role)}
        if role == "scheduler" and self.metrics_port is not None:
            meta["annotations"] = {  # Prometheus' kubernetes_sd pod-annotation convention
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(self.metrics_port),
                "prometheus.io/path": "/metrics",
            }
        return {"metadata": meta, "spec": spec}

    def job_spec(self, role: str) -> dict:
        n = {"scheduler": 1, "server": self.num_servers, "worker": self.num_workers}[role]
        return {
            "completionMode": "Indexed",
            "completions": n,
            "parallelism": n,
            "backoffLimit": 0,  # a node that died cannot rejoin: the job fails with it
            "template": self.pod_template(role),
        }

    # -- objects ----------------------------------------------------------------------------
    def meta(self, name: str, role: str | None = None) -> dict:
        return {"name": name, "namespace": self.namespace, "labels": self.labels(role)}

    def secret_object(self, token: str) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self.meta(self.secret_ref),
            "type": "Opaque",
            "data": {SECRET_KEY: base64.b64encode(token.encode()).decode()},
        }

    def jobset(self) -> dict:
        return {
            "apiVersion": JOBSET_API,
            "kind": "JobSet",
            "metadata": self.meta(self.name),
            "spec": {
                "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                "failurePolicy": {"maxRestarts": 0},
                "successPolicy": {"operator": "All", "targetReplicatedJobs": ["worker"]},
                "replicatedJobs": [
                    {
                        "name": role,
                        "replicas": 1,
                        "template": {
                            "metadata": {"labels": self.labels(role)},
                            "spec": self.job_spec(role),
                        },
                    }
                    for role in ROLES
                ],
            },
        }

    def service(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(self.name),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": self.labels(),
                "ports": [
                    {"name": n, "port": p, "targetPort": p, "protocol": "TCP"}
                    for n, p in self.ports
                ],
            },
        }

    def owner_patch(self, uid: str) -> dict:
        """The merge patch that makes the job (the JobSet, or the scheduler's Job) own the
        Secret, so that deleting the job deletes it: ``kubectl patch secret NAME --type merge
        -p PATCH`` with the owner's ``metadata.uid`` (known only once it exists)."""
        if self.kind == "jobset":
            api, kind, name = JOBSET_API, "JobSet", self.name
        else:
            api, kind, name = "batch/v1", "Job", self.job_name("scheduler")
        return {
            "metadata": {
                "ownerReferences": [
                    {"apiVersion": api, "kind": kind, "name": name, "uid": uid,
                     "blockOwnerDeletion": False, "controller": False}
                ]
            }
        }  # fmt: skip

    def owner_commands(self) -> list[str]:
        """What to run after ``kubectl apply``: the Secret gets the job as its owner."""
        kind, name = (
            ("jobset", self.name) if self.kind == "jobset" else ("job", self.job_name("scheduler"))
        )
        patch = json.dumps(self.owner_patch("UID"), separators=(",", ":"))
        patch = patch.replace('"UID"', '"\'"$uid"\'"')
        ns = f"-n {self.namespace}"
        return [
            f"uid=$(kubectl get {kind} {name} {ns} -o jsonpath='{{.metadata.uid}}')",
            f"kubectl patch secret {self.secret_ref} {ns} --type merge -p '{patch}'",
        ]

    def job(self, role: str) -> dict:
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": self.meta(self.job_name(role), role),
            "spec": self.job_spec(role),
        }

    def manifests(self, token: str | None = None) -> list[dict]:
        """Every object, in the order to apply them: the Secret (unless ``secret_name``),
        then the JobSet, or the Service and the three Jobs. ``token``: the secret (default a
        fresh one)."""
        self.check()
        objs = []
        if self.secret_name is None:
            objs.append(self.secret_object(token or secrets.token_hex(32)))
        if self.kind == "jobset":
            objs.append(self.jobset())
        else:
            objs.append(self.service())
            objs += [self.job(role) for role in ROLES]
        return objs
