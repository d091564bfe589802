"""`hetps k8s`: its manifests checked against the Kubernetes API's models (the `kubernetes`
client's model classes, strictly) and the JobSet CRD's schema; the DMLC_* contract in each pod;
the secret only in a Secret."""

from __future__ import annotations

import base64
import copy
import os
import stat

import pytest

pytest.importorskip("kubernetes", reason="needs the kubernetes client: pip install 'hetps[k8s]'")
yaml = pytest.importorskip("yaml")
pytest.importorskip("jsonschema")

from hetps.cli import main as cli_main  # noqa: E402
from hetps.launch.k8s import to_yaml  # noqa: E402
from hetps.launch.k8s_manifests import INDEX_ANNOTATION, K8sJob  # noqa: E402
from k8s_check import ManifestInvalid, check_manifest  # noqa: E402

CMD = ["python", "/app/train.py", "--epochs", "1"]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["k8s", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _job(**kw) -> K8sJob:
    args = dict(
        name="linreg",
        image="registry.example/hetps:0.1",
        command=CMD,
        num_workers=3,
        num_servers=2,
        namespace="ml",
        worker_resources={"cpu": "2", "memory": "2Gi"},
        server_resources={"cpu": "500m"},
    )
    args.update(kw)
    return K8sJob(**args)


def _pod_specs(objs: list[dict]) -> dict[str, dict]:
    """role -> (job spec) of the JobSet's replicated jobs or of the plain Jobs."""
    out = {}
    for obj in objs:
        if obj["kind"] == "JobSet":
            for rj in obj["spec"]["replicatedJobs"]:
                out[rj["name"]] = rj["template"]["spec"]
        elif obj["kind"] == "Job":
            out[obj["metadata"]["labels"]["hetps.io/role"]] = obj["spec"]
    return out


def _env(job_spec: dict) -> dict[str, dict]:
    (container,) = job_spec["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
def test_the_cli_writes_manifests_the_kubernetes_models_accept(capsys, kind):
    code, out, err = _cli(
        capsys,
        "-n", "3", "-s", "2", "--image", "registry.example/hetps:0.1", "--name", "linreg",
        "--namespace", "ml", "--kind", kind, "--worker-resources", "cpu=2,memory=2Gi,nvidia.com/gpu=1",
        "--server-resources", "cpu=500m", "--env", "PS_VERBOSE=1", "--", *CMD,
    )  # fmt: skip
    assert code == 0, err
    objs = list(yaml.safe_load_all(out))
    kinds = [o["kind"] for o in objs]
    assert kinds == (
        ["Secret", "JobSet"] if kind == "jobset" else ["Secret", "Service", "Job", "Job", "Job"]
    )
    for obj in objs:
        check_manifest(obj)  # raises with the field's path when the API would refuse it
    # what the YAML says is what the objects are (the emitter loses nothing)
    job = _job(kind=kind, env={"PS_VERBOSE": "1"})
    job.worker_resources["nvidia.com/gpu"] = "1"
    token = base64.b64decode(objs[0]["data"]["secret"]).decode()
    assert objs == job.manifests(token)


def test_the_validator_refuses_what_the_api_server_would():
    """The checks can fail: an unknown field, a wrong type, a missing required field, a bad
    JobSet field each raise."""
    objs = _job().manifests("x" * 64)
    jobset = objs[1]
    check_manifest(jobset)
    broken = []
    b = copy.deepcopy(jobset)
    b["spec"]["replicatedJobs"][2]["template"]["spec"]["template"]["spec"]["contianers"] = []
    broken.append(b)
    b = copy.deepcopy(jobset)
    b["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = "1"
    broken.append(b)
    b = copy.deepcopy(jobset)
    del b["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0][
        "name"
    ]
    broken.append(b)
    b = copy.deepcopy(jobset)
    b["spec"]["successPolicy"]["operator"] = "Most"
    broken.append(b)
    b = copy.deepcopy(jobset)
    b["spec"]["replicatedJobs"][0]["replica"] = 1
    broken.append(b)
    b = copy.deepcopy(objs[0])
    b["stringdata"] = {}
    broken.append(b)
    for b in broken:
        with pytest.raises(ManifestInvalid):
            check_manifest(b)


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
def test_every_pod_gets_the_dmlc_environment_and_its_rank(kind):
    job = _job(kind=kind)
    objs = job.manifests("s" * 64)
    specs = _pod_specs(objs)
    assert set(specs) == {"scheduler", "server", "worker"}
    counts = {"scheduler": 1, "server": 2, "worker": 3}
    host = "linreg-scheduler-0-0.linreg" if kind == "jobset" else "linreg-scheduler-0.linreg"
    for role, spec in specs.items():
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == counts[role]
        assert spec["backoffLimit"] == 0
        env = _env(spec)
        assert env["DMLC_ROLE"]["value"] == role
        assert env["DMLC_PS_ROOT_URI"]["value"] == host
        assert env["DMLC_PS_ROOT_PORT"]["value"] == "9091"
        assert env["DMLC_NUM_SERVER"]["value"] == "2" and env["DMLC_NUM_WORKER"]["value"] == "3"
        assert env["DMLC_NODE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        if role == "scheduler":
            assert "HETPS_LAUNCH_RANK" not in env
        else:
            ref = env["HETPS_LAUNCH_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == f"metadata.annotations['{INDEX_ANNOTATION}']"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["command"] == (CMD if role == "worker" else ["hetps", role])
    assert _env(specs["worker"])["OMP_NUM_THREADS"]["value"] == "2"  # cpu=2
    assert _env(specs["server"])["OMP_NUM_THREADS"]["value"] == "1"
    if kind == "jobs":
        # the scheduler's DNS name: hostname JOB-INDEX in the subdomain of the headless Service
        svc = objs[1]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
        sched_job = next(o for o in objs if o["metadata"]["name"] == "linreg-scheduler")
        pod = sched_job["spec"]["template"]
        assert pod["spec"]["subdomain"] == svc["metadata"]["name"] == host.split(".")[1]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    else:
        js = objs[1]
        assert js["spec"]["network"]["enableDNSHostnames"] is True
        # JobSet names pods NAME-RJOB-JOBINDEX-PODINDEX in the subdomain NAME
        assert f"{js['metadata']['name']}-scheduler-0-0.{js['metadata']['name']}" == host


def test_the_secret_is_only_in_the_secret():
    job = _job()
    token = "f00d" * 16
    objs = job.manifests(token)
    text = to_yaml(objs)
    assert token not in text  # never in clear
    assert text.count(base64.b64encode(token.encode()).decode()) == 1
    secret = objs[0]
    assert secret["kind"] == "Secret" and secret["type"] == "Opaque"
    for spec in _pod_specs(objs).values():
        ref = _env(spec)["HETPS_SECRET"]
        assert "value" not in ref
        assert ref["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"],
            "key": "secret",
        }
    # each call makes a fresh secret
    assert K8sJob(**{**job.__dict__}).manifests()[0]["data"] != _job().manifests()[0]["data"]
    # an existing Secret: no Secret object, every pod refers to it
    objs = _job(secret_name="team-hetps").manifests()
    assert [o["kind"] for o in objs] == ["JobSet"]
    for spec in _pod_specs(objs).values():
        assert _env(spec)["HETPS_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "team-hetps"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--name", "Lin_Reg"], "--name 'Lin_Reg': use lowercase letters"),
        (["--env", "HETPS_SECRET=abc"], "the cluster secret goes in a Kubernetes Secret"),
        (["--env", "DMLC_ROLE=worker"], "hetps k8s sets it for every pod"),
        (["--worker-resources", "cpu=two"], "cpu='two' is not a Kubernetes quantity"),
        (["--worker-resources", "cpu"], "each item must look like NAME=QUANTITY"),
        (["--port", "0"], "--port 0: use a TCP port from 1 to 65535"),
        (["-s", "0"], "-s/--num-servers must be >= 1"),
    ],
)
def test_bad_options_are_one_line_naming_the_fix(capsys, argv, message):
    code, out, err = _cli(capsys, "-n", "2", "--image", "img", *argv, "--", *CMD)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_no_command_is_an_error(capsys):
    code, out, err = _cli(capsys, "-n", "2", "--image", "img")
    assert code == 2 and "give the worker command after --" in err


def test_out_dir_writes_one_file_per_object_and_the_secret_0600(capsys, tmp_path):
    out_dir = tmp_path / "m"
    code, out, err = _cli(capsys, "-n", "1", "--image", "img", "-o", str(out_dir), "--", *CMD)
    assert code == 0, err
    files = sorted(os.listdir(out_dir))
    assert files == ["00-secret-hetps-secret.yaml", "01-jobset-hetps.yaml"]
    assert stat.S_IMODE(os.stat(out_dir / files[0]).st_mode) == 0o600
    for f in files:
        for obj in yaml.safe_load_all((out_dir / f).read_text()):
            check_manifest(obj)
    assert f"kubectl apply -f {out_dir}" in err
    # a second run does not overwrite the secret a job may be using
    code, out, err = _cli(capsys, "-n", "1", "--image", "img", "-o", str(out_dir), "--", *CMD)
    assert code == 2 and "is never overwritten" in err


def _restricted_violations(pod: dict) -> list[str]:
    """What the "restricted" Pod Security Standard (Kubernetes 1.30) refuses in a pod spec."""
    out = []
    psc = pod.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(key)
    for v in pod.get("volumes", []):
        allowed = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                   "persistentVolumeClaim", "projected", "secret")  # fmt: skip
        if not any(k in v for k in allowed):
            out.append(f"volume {v}")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    pod_seccomp = psc.get("seccompProfile", {}).get("type")
    for c in pod["containers"]:
        csc = c.get("securityContext", {})
        name = c["name"]
        if csc.get("privileged"):
            out.append(f"{name}: privileged")
        if csc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = csc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities added")
        if not csc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot")
        if csc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        if csc.get("seccompProfile", {}).get("type", pod_seccomp) not in (
            "RuntimeDefault",
            "Localhost",
        ):
            out.append(f"{name}: seccompProfile")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                out.append(f"{name}: hostPort")
    return out


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
def test_every_pod_passes_the_restricted_pod_security_standard(kind):
    specs = _pod_specs(_job(kind=kind).manifests())
    assert set(specs) == {"scheduler", "server", "worker"}
    for role, spec in specs.items():
        pod = spec["template"]["spec"]
        assert _restricted_violations(pod) == [], role
        assert pod["securityContext"]["runAsUser"] == 1000
    # the check itself refuses what the API server would
    pod = copy.deepcopy(specs["worker"]["template"]["spec"])
    del pod["containers"][0]["securityContext"]
    assert len(_restricted_violations(pod)) == 2  # escalation, capabilities


@pytest.mark.parametrize("kind", ["jobset", "jobs"])
def test_the_scheduler_serves_its_dashboard_with_scrape_annotations(kind):
    objs = _job(kind=kind).manifests()
    specs = _pod_specs(objs)
    sched = specs["scheduler"]["template"]
    env = _env(specs["scheduler"])
    assert env["HETPS_METRICS_PORT"]["value"] == "9100"
    assert env["HETPS_METRICS_HOST"]["value"] == env["DMLC_PS_ROOT_URI"]["value"]
    assert sched["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9100",
        "prometheus.io/path": "/metrics",
    }  # fmt: skip
    (container,) = sched["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    for role in ("server", "worker"):
        assert "HETPS_METRICS_PORT" not in _env(specs[role])
        assert "annotations" not in specs[role]["template"]["metadata"]
    if kind == "jobs":
        (svc,) = [o for o in objs if o["kind"] == "Service"]
        assert {p["name"] for p in svc["spec"]["ports"]} == {"scheduler", "metrics"}
    off = _pod_specs(_job(kind=kind, metrics_port=None).manifests())
    assert "HETPS_METRICS_PORT" not in _env(off["scheduler"])
    assert "annotations" not in off["scheduler"]["template"]["metadata"]
    for obj in objs:
        check_manifest(obj)


@pytest.mark.parametrize("kind, owner", [("jobset", "JobSet"), ("jobs", "Job")])
def test_the_secret_gets_the_job_as_its_owner(capsys, kind, owner):
    from kubernetes.client import V1OwnerReference

    job = _job(kind=kind)
    patch = job.owner_patch("1234-abcd")
    (ref,) = patch["metadata"]["ownerReferences"]
    V1OwnerReference(**{"api_version": ref["apiVersion"], "kind": ref["kind"],
                        "name": ref["name"], "uid": ref["uid"]})  # fmt: skip
    assert ref["kind"] == owner and ref["uid"] == "1234-abcd"
    names = {(o["kind"], o["metadata"]["name"]) for o in job.manifests()}
    assert (owner, ref["name"]) in names
    # the commands hetps k8s prints put the owner's uid into the patch, in a real shell
    get, patch_cmd = job.owner_commands()
    assert get.startswith("uid=$(kubectl get ")
    shown = patch_cmd.replace(
        f"kubectl patch secret {job.secret_ref} -n ml --type merge -p", "printf %s"
    )
    import json
    import subprocess

    res = subprocess.run(["bash", "-c", f"uid=1234-abcd; {shown}"], capture_output=True, text=True)
    assert json.loads(res.stdout) == patch
    code, out, err = _cli(capsys, "-n", "1", "--image", "x", "--kind", kind, "--", "python", "t.py")
    assert code == 0 and "make the job own its Secret" in err
    code, out, err = _cli(capsys, "-n", "1", "--image", "x", "--secret-name", "mine", "--", "t")
    assert code == 0 and "own its Secret" not in err  # a Secret of yours stays yours
