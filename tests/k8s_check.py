"""Checking Kubernetes manifests as the API server would, without a cluster.

* Built-in kinds (Secret, Service, Job, and the Job templates inside a JobSet): walked field by
  field against the ``kubernetes`` client's model classes (``openapi_types`` and
  ``attribute_map``, generated from the Kubernetes OpenAPI spec): an unknown field or a value
  of the wrong type is an error, as the API server's strict field validation makes it; then
  built through ``ApiClient().deserialize``, whose (pydantic, strict) models refuse a missing
  required field or a wrongly typed value.
* The JobSet itself: against :data:`JOBSET_SCHEMA`, the part of the JobSet CRD's OpenAPI v3
  schema (``jobset.x-k8s.io/v1alpha2``) that sits above the Job templates, written out here
  from kubernetes-sigs/jobset ``config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml``
  (commit 01078527ec4383c3d7289b5af3e0a788324e14ec): every field of ``spec`` and of a
  replicated job, their types, enums and required fields, with unknown fields refused (the
  API server prunes or, with strict validation, rejects them).
"""

from __future__ import annotations

import json
import re

from kubernetes import client

PRIMITIVES = {
    "str": str,
    "int": int,
    "bool": bool,
    "float": (int, float),
    "object": object,  # IntOrString, RawExtension: anything
    "datetime": str,
    "date": str,
    "bytes": str,  # base64 in JSON (a Secret's data)
}


class ManifestInvalid(AssertionError):
    pass


def strict(data, typ: str, path: str = "") -> None:
    """Raise ManifestInvalid where ``data`` does not fit the client's type ``typ``."""
    m = re.fullmatch(r"(?:list|List)\[(.+)\]", typ)
    if m:
        if not isinstance(data, list):
            raise ManifestInvalid(f"{path}: expected a list, got {type(data).__name__}")
        for i, x in enumerate(data):
            strict(x, m.group(1), f"{path}[{i}]")
        return
    # dict(str, X) in older clients, Dict[str, X] in newer ones
    m = re.fullmatch(r"dict\(([^,]+), (.+)\)", typ) or re.fullmatch(r"Dict\[([^,]+), (.+)\]", typ)
    if m:
        if not isinstance(data, dict):
            raise ManifestInvalid(f"{path}: expected a map, got {type(data).__name__}")
        for k, v in data.items():
            strict(v, m.group(2), f"{path}.{k}")
        return
    if typ in PRIMITIVES:
        want = PRIMITIVES[typ]
        if typ == "int" and isinstance(data, bool) or not isinstance(data, want):
            raise ManifestInvalid(f"{path}: expected {typ}, got {data!r}")
        return
    cls = getattr(client.models, typ)
    if not isinstance(data, dict):
        raise ManifestInvalid(f"{path}: expected a {typ} object, got {data!r}")
    by_json = {v: k for k, v in cls.attribute_map.items()}
    for key, value in data.items():
        if key not in by_json:
            raise ManifestInvalid(f"{path}.{key}: unknown field of {typ}")
        strict(value, cls.openapi_types[by_json[key]], f"{path}.{key}")


def build(obj, typ: str):
    """``obj`` as the client's model: its (pydantic) models raise a ValueError for a missing
    required field or a value of the wrong type."""
    return client.ApiClient().deserialize(json.dumps(obj), typ, "application/json")


def check_builtin(obj, typ: str, path: str = "") -> None:
    strict(obj, typ, path)
    try:
        build(obj, typ)
    except ValueError as exc:
        raise ManifestInvalid(f"{path or typ}: {exc}") from None


_STR = {"type": "string"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STRS = {"type": "array", "items": _STR}


def _obj(props: dict, required=()) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(required),
        "additionalProperties": False,
    }


#: JobSet v1alpha2 above its Job templates (see the module's doc for the source)
JOBSET_SCHEMA = _obj(
    {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object"},  # checked as V1ObjectMeta
        "spec": _obj(
            {
                "coordinator": _obj(
                    {"jobIndex": _INT, "podIndex": _INT, "replicatedJob": _STR},
                    ["replicatedJob"],
                ),
                "failurePolicy": _obj(
                    {
                        "maxRestarts": _INT,
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                        "rules": {
                            "type": "array",
                            "items": _obj(
                                {
                                    "action": {
                                        "enum": [
                                            "FailJobSet",
                                            "RestartJobSet",
                                            "RestartJobSetAndIgnoreMaxRestarts",
                                        ]
                                    },
                                    "name": _STR,
                                    "onJobFailureReasons": _STRS,
                                    "targetReplicatedJobs": _STRS,
                                },
                                ["action", "name"],
                            ),
                        },
                    }
                ),
                "managedBy": _STR,
                "network": _obj(
                    {
                        "enableDNSHostnames": _BOOL,
                        "publishNotReadyAddresses": _BOOL,
                        "subdomain": _STR,
                    }
                ),
                "replicatedJobs": {
                    "type": "array",
                    "items": _obj(
                        {
                            "dependsOn": {
                                "type": "array",
                                "maxItems": 1,
                                "items": _obj(
                                    {"name": _STR, "status": {"enum": ["Ready", "Complete"]}},
                                    ["name", "status"],
                                ),
                            },
                            "groupName": _STR,
                            "name": _STR,
                            "replicas": _INT,
                            # metadata + spec: checked as V1JobTemplateSpec
                            "template": {"type": "object"},
                        },
                        ["name", "template"],
                    ),
                },
                "startupPolicy": _obj(
                    {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}},
                    ["startupPolicyOrder"],
                ),
                "successPolicy": _obj(
                    {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _STRS},
                    ["operator"],
                ),
                "suspend": _BOOL,
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
            }
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)

BUILTIN = {
    ("v1", "Secret"): "V1Secret",
    ("v1", "Service"): "V1Service",
    ("batch/v1", "Job"): "V1Job",
}


def check_manifest(obj: dict) -> None:
    """Raise ManifestInvalid unless ``obj`` is a valid object of its kind."""
    import jsonschema

    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in BUILTIN:
        check_builtin(obj, BUILTIN[key], obj["kind"])
        return
    if key != ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        raise ManifestInvalid(f"unexpected object {key}")
    try:
        jsonschema.validate(obj, JOBSET_SCHEMA)
    except jsonschema.ValidationError as exc:
        raise ManifestInvalid(f"JobSet: {exc.message} at {list(exc.absolute_path)}") from None
    check_builtin(obj["metadata"], "V1ObjectMeta", "JobSet.metadata")
    for i, rj in enumerate(obj["spec"]["replicatedJobs"]):
        check_builtin(rj["template"], "V1JobTemplateSpec", f"JobSet.replicatedJobs[{i}].template")
