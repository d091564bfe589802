"""The pods of `hetps k8s` manifests, run here as processes with exactly the environment the
manifests give each pod: a small "kubelet" resolves every env entry (values, the downward
API's pod IP and completion-index annotation, secretKeyRef from the Secret in the same
manifests), adds what Kubernetes adds (JOB_COMPLETION_INDEX) and what the image would have
(PATH, HOME, this checkout on PYTHONPATH), and maps the scheduler's DNS name to 127.0.0.1.
Pods start in reverse order (workers first), as Kubernetes promises no order."""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hetps.launch.k8s_manifests import INDEX_ANNOTATION, K8sJob

ROOT = Path(__file__).resolve().parents[2]
HOST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "HETPS_HOST_GROUP",
    "MASTER_ADDR",
)
JOB_CMD = ["python", "examples/linear_regression.py", "--epochs", "1", "--num-samples", "2000"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pods(objs: list[dict]) -> list[tuple[str, int, dict]]:
    """(role, completion index, container) of every pod the manifests make."""
    jobs = []
    for obj in objs:
        if obj["kind"] == "JobSet":
            for rj in obj["spec"]["replicatedJobs"]:
                assert rj["replicas"] == 1
                jobs.append((rj["name"], rj["template"]["spec"]))
        elif obj["kind"] == "Job":
            jobs.append((obj["metadata"]["labels"]["hetps.io/role"], obj["spec"]))
    pods = []
    for role, spec in jobs:
        assert spec["completionMode"] == "Indexed"
        (container,) = spec["template"]["spec"]["containers"]
        pods += [(role, i, container) for i in range(spec["completions"])]
    return pods


def _resolve_env(container: dict, index: int, objs: list[dict]) -> dict[str, str]:
    """The container's env as the kubelet would set it (pod IP 127.0.0.1)."""
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    env = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            values = {
                "status.podIP": "127.0.0.1",
                f"metadata.annotations['{INDEX_ANNOTATION}']": str(index),
            }
            assert path in values, f"no such downward API field here: {path}"
            env[e["name"]] = values[path]
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            secret = secrets[ref["name"]]  # a missing Secret: the pod would never start
            env[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        else:
            raise AssertionError(f"unexpected env source {src}")
    env["JOB_COMPLETION_INDEX"] = str(index)  # set by the Job controller for Indexed Jobs
    return env


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
def test_the_manifests_pods_run_the_example_with_their_own_env(kind):
    job = K8sJob(
        name="linreg",
        image="unused",
        command=JOB_CMD,
        num_workers=2,
        num_servers=1,
        kind=kind,
        port=_free_port(),
        env={"PS_HEARTBEAT_INTERVAL": "0.5"},
    )
    objs = job.manifests()
    pods = _pods(objs)
    assert sorted((r, i) for r, i, _ in pods) == [
        ("scheduler", 0),
        ("server", 0),
        ("worker", 0),
        ("worker", 1),
    ]
    image_env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(ROOT / "src"),
    }
    procs: list[tuple[str, int, subprocess.Popen]] = []
    outputs: dict[tuple[str, int], list[str]] = {}
    readers = []
    try:
        for role, index, container in sorted(
            pods, key=lambda p: ("worker", "server", "scheduler").index(p[0])
        ):
            env = _resolve_env(container, index, objs)
            assert env["DMLC_PS_ROOT_URI"] == job.scheduler_host
            for name, value in env.items():  # this test's DNS: the scheduler's name is here
                if value == job.scheduler_host:
                    env[name] = "127.0.0.1"
            if role == "scheduler":  # the dashboard and /metrics on the scheduler's address
                assert env["HETPS_METRICS_HOST"] == env["DMLC_PS_ROOT_URI"]
                env["HETPS_METRICS_PORT"] = "0"  # any free port here (a pod has its own)
            assert env["HETPS_SECRET"] and len(env["HETPS_SECRET"]) == 64
            # torchrun's variables: a worker pod is a host of one worker; other pods get none
            host = {k: env.get(k) for k in HOST_VARS}
            if role == "worker":
                i = str(index)
                assert host == dict(zip(HOST_VARS, [i, "2", "0", "1", i, i, None], strict=True))
            else:
                assert host == dict.fromkeys(HOST_VARS)
            proc = subprocess.Popen(
                container["command"],
                env={**image_env, **env},
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            procs.append((role, index, proc))
            lines = outputs[(role, index)] = []
            t = threading.Thread(
                target=lambda p=proc, out=lines: out.extend(
                    ln.decode("utf-8", "replace") for ln in p.stdout
                ),
                daemon=True,
            )
            t.start()
            readers.append(t)
        codes = {}
        for role, index, proc in procs:
            try:
                codes[(role, index)] = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                codes[(role, index)] = None
        for t in readers:
            t.join(timeout=5)
    finally:
        for _, _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything the pod left in its group
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    text = "\n".join(f"[{r} {i}] {''.join(lines)}" for (r, i), lines in outputs.items())
    assert all(c == 0 for c in codes.values()), (codes, text)
    mse = {}
    for i in (0, 1):
        out = "".join(outputs[("worker", i)])
        # the pod with completion index i is worker rank i
        m = re.search(rf"^Worker\[{i}\] Epoch\[0\] Train-mse=([\d.]+)$", out, re.M)
        assert m, text
        mse[i] = m.group(1)
    assert mse[0] == mse[1], text  # one synchronous model
    assert float(mse[0]) < 2.0, text
