"""The Helm chart and the container images, checked without a cluster or a Docker engine.

Rendering and linting go through Helm's own Go engine (helm-python-sdk wraps the Helm v4 SDK), so template
functions, value coalescing and values.schema.json validation behave exactly as in `helm install`. Every
rendered object is then validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown
fields fail) or, for KEDA and prometheus-operator kinds, against models generated from their CRDs (cloudcoil).
The Dockerfiles cannot be built here, so their tests read them statically.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor

from specserve.queue.connection import connect
from specserve.queue.embedded import free_port, valkey_server_binary
from specserve.queue.keys import Keys
from specserve.service.config import ServiceConfig, from_args
from specserve.service.launch import check_api_exposure

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "specserve"
CI_VALUES = {
    path.name.removesuffix("-values.yaml"): path for path in sorted((CHART / "ci").glob("*-values.yaml"))
}
# Corners the ci/ files do not reach, rendered and checked like them.
EXTRA_VALUES: dict[str, dict[str, Any]] = {
    "external-minimal": {
        "redis": {"mode": "external", "external": {"host": "redis.example.com"}},
        "worker": {"keda": {"enabled": True}},
    },
    "external-inline-password": {
        "redis": {
            "mode": "external",
            "external": {"host": "redis.example.com", "password": "abc123", "tls": {"enabled": True}},
        },
        "worker": {"keda": {"enabled": True}},
    },
    "external-cluster": {
        "redis": {
            "mode": "external",
            "external": {
                "host": "clustercfg.example.com",
                "existingSecret": "redis-auth",
                "tls": {"enabled": True, "caSecret": "redis-ca"},
                "cluster": {
                    "enabled": True,
                    "seedNodes": ["node-b.example.com:6379", "node-c.example.com:6380"],
                },
            },
        },
        "worker": {"keda": {"enabled": True}},
    },
    "features-off": {
        "metrics": {"podAnnotations": False},
        "networkPolicy": {"enabled": False},
        "serviceAccount": {"create": False},
        "tests": {"enabled": False},
        "api": {"auth": {"existingSecret": "team-keys"}, "pdb": {"enabled": False}},
        "worker": {"pdb": {"enabled": False}},
    },
    "model-image-copy": {"model": {"source": "initContainer", "path": "/models/llama"}},
    # a vLLM user's settings: the engine's flags by their vLLM names, vLLM's metric names, a suffixed tag
    "vllm-flags": {
        "image": {"tag": "0.2.0-cuda"},
        "model": {"path": "Qwen/Qwen3-8B", "servedModelName": ["qwen3", "qwen"]},
        "engine": {
            "maxModelLen": 8192,
            "quantization": "int8",
            "tensorParallelSize": 2,
            "toolCallParser": "hermes",
            "speculative": {"method": "ngram", "numTokens": 3, "promptLookupMax": 4},
        },
        "worker": {"gpu": {"count": 2}, "cacheSizeLimit": "40Gi"},
        "metrics": {"prefix": "vllm", "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}},
    },
}
VALUE_SETS = ["default", *CI_VALUES, *EXTRA_VALUES]
RELEASE = "rel"
NAMESPACE = "specserve"
# The chart's kubeVersion floor and the newest schemas shipped with kubernetes-validate.
KUBE_VERSIONS = ["1.25", kubernetes_validate.latest_version()]
CRD_MODELS = {
    ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TriggerAuthentication,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
}
Manifest = dict[str, Any]


def values_of(value_set: str) -> dict[str, Any] | None:
    if value_set == "default":
        return None
    if value_set in EXTRA_VALUES:
        return EXTRA_VALUES[value_set]
    return yaml.safe_load(CI_VALUES[value_set].read_text())


def render(values: dict[str, Any] | None) -> list[Manifest]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        doc
        for name, text in sorted(rendered.items())
        if name.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@cache
def rendered(value_set: str) -> tuple[Manifest, ...]:
    return tuple(render(values_of(value_set)))


def merged_values(value_set: str) -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values_of(value_set))


def find(docs: tuple[Manifest, ...] | list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: tuple[Manifest, ...] | list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = find(docs, kind, name)
    assert len(found) == 1, (
        f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    )
    return found[0]


def deployment(docs: tuple[Manifest, ...], component: str) -> Manifest:
    (dep,) = [
        d
        for d in find(docs, "Deployment")
        if d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component
    ]
    return dep


def container(dep: Manifest, name: str) -> Manifest:
    (found,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def env_of(ctr: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in ctr.get("env", [])}


# Stand-ins for what the kubelet injects: Secret values and downward-API fields.
SECRET_VALUE = "s3cret-Value_1"
FIELD_VALUES = {"metadata.name": "pod-0", "metadata.namespace": NAMESPACE, "spec.nodeName": "node-a"}


def kubelet_env(ctr: Manifest) -> dict[str, str]:
    """The environment as the kubelet builds it: references resolved, $(NAME) expanded in order."""
    env: dict[str, str] = {}
    for entry in ctr.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], entry["value"]
            )
        elif "secretKeyRef" in entry["valueFrom"]:
            env[entry["name"]] = SECRET_VALUE
        else:
            env[entry["name"]] = FIELD_VALUES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def pod_specs(docs: tuple[Manifest, ...]) -> Iterator[tuple[str, Manifest]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            yield f"Pod/{d['metadata']['name']}", d["spec"]


def helm_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    return str(caught.value)


# --- helm lint / helm template ------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_strict_reports_no_warning(value_set: str) -> None:
    report = helm.lint(CHART, values_of(value_set), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("value_set", VALUE_SETS)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_matches_its_schema(value_set: str, kube_version: str) -> None:
    docs = rendered(value_set)
    assert len(docs) >= 8
    for doc in docs:
        model = CRD_MODELS.get((doc["apiVersion"], doc["kind"]))
        if model is not None:
            # The CRD models ignore unknown fields, so a field lost in the round trip was not in the CRD.
            parsed = model.model_validate(doc)
            assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(str(p) for p in err.path)
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            pytest.fail(f"{name} invalid for Kubernetes {kube_version} at {where}: {err.message}")


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_env_references_resolve_to_earlier_variables(value_set: str) -> None:
    # The kubelet expands $(NAME) only for variables declared earlier in the same container; anything else
    # stays literal, e.g. a REDIS_URL with "$(SPECSERVE_REDIS_PASSWORD)" as its password.
    for where, spec in pod_specs(rendered(value_set)):
        for ctr in spec.get("initContainers", []) + spec["containers"]:
            declared: set[str] = set()
            for entry in ctr.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", entry.get("value", "")):
                    assert ref in declared, f"{where}/{ctr['name']}: {entry['name']} uses $({ref}) before it"
                declared.add(entry["name"])
            for arg in ctr.get("args", []) + ctr.get("command", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert ref in declared, f"{where}/{ctr['name']}: argument uses undeclared $({ref})"


# --- workers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value_set", "resource", "count", "device", "variant"),
    [
        ("default", "nvidia.com/gpu", 1, "cuda", "cuda"),
        ("all-on", "nvidia.com/gpu", 1, "cuda", "cuda12"),
        ("external-redis", "nvidia.com/mig-3g.40gb", 1, "cuda", "cuda"),
    ],
)
def test_gpu_workers_get_gpu_limits(
    value_set: str, resource: str, count: int, device: str, variant: str
) -> None:
    worker = container(deployment(rendered(value_set), "worker"), "worker")
    assert worker["resources"]["limits"][resource] == count
    assert env_of(worker)["SPECSERVE_DEVICE"] == device
    assert worker["image"].endswith(variant)


def test_cpu_workers_request_no_gpu_and_use_the_cpu_image() -> None:
    worker = container(deployment(rendered("cpu"), "worker"), "worker")
    assert not [name for name in worker["resources"].get("limits", {}) if "gpu" in name]
    assert env_of(worker)["SPECSERVE_DEVICE"] == "cpu"
    assert worker["image"] == "specserve:0.1.0-cpu"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_worker_probes_survive_a_long_model_load(value_set: str) -> None:
    worker = container(deployment(rendered(value_set), "worker"), "worker")
    env = env_of(worker)
    (port,) = [p for p in worker["ports"] if p["name"] == "health"]
    assert port["containerPort"] == int(env["SPECSERVE_HEALTH_PORT"])
    startup, liveness, readiness = worker["startupProbe"], worker["livenessProbe"], worker["readinessProbe"]
    for probe in (startup, liveness, readiness):
        assert probe["httpGet"]["port"] == "health"
    assert startup["httpGet"]["path"] == "/readyz"
    assert readiness["httpGet"]["path"] == "/readyz"
    assert liveness["httpGet"]["path"] == "/healthz"
    # Liveness only starts once the startup probe passed; the startup budget must cover a large model's load.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_worker_grace_period_covers_prestop_and_drain(value_set: str) -> None:
    dep = deployment(rendered(value_set), "worker")
    worker = container(dep, "worker")
    command = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause, drain = int(command[1]), int(env_of(worker)["SPECSERVE_DRAIN_TIMEOUT"])
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pause + drain + 5


def test_default_grace_period_is_derived_from_the_drain_timeout() -> None:
    dep = deployment(
        tuple(render({"worker": {"drainTimeoutSeconds": 300, "preStopSleepSeconds": 2}})), "worker"
    )
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 2 + 300 + 15
    assert env_of(container(dep, "worker"))["SPECSERVE_DRAIN_TIMEOUT"] == "300"


def test_a_hugging_face_id_reaches_the_worker_with_its_revision_token_and_offline_switch() -> None:
    values = {
        "model": {
            "path": "Qwen/Qwen3-0.6B",
            "revision": "v1.1",
            "huggingface": {"tokenSecret": {"name": "hf-token"}, "offline": True},
        }
    }
    worker = container(deployment(tuple(render(values)), "worker"), "worker")
    env = env_of(worker)
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"].startswith("/cache")
    cfg = from_args(environ=kubelet_env(worker))
    assert cfg.model == "Qwen/Qwen3-0.6B" and cfg.revision == "v1.1"
    default = env_of(container(deployment(rendered("default"), "worker"), "worker"))
    assert not {"HF_TOKEN", "HF_HUB_OFFLINE", "SPECSERVE_REVISION"} & set(default)


def test_gpu_memory_utilization_reaches_the_engine() -> None:
    worker = container(
        deployment(tuple(render({"engine": {"gpuMemoryUtilization": 0.8}})), "worker"), "worker"
    )
    assert from_args(environ=kubelet_env(worker)).engine_kwargs()["gpu_memory_utilization"] == 0.8
    message = helm_error({"engine": {"gpuMemoryUtilization": 1.5}})
    assert "gpuMemoryUtilization" in message


def test_gpus_per_worker_become_the_tensor_parallel_size() -> None:
    """Two GPUs in a pod split the model over both (the engine's ranks), as the worker's config reads it."""
    worker = container(deployment(tuple(render({"worker": {"gpu": {"count": 2}}})), "worker"), "worker")
    kwargs = from_args(environ=kubelet_env(worker)).engine_kwargs()
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["device"] == "cuda"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    one = container(deployment(tuple(render({})), "worker"), "worker")
    assert "tensor_parallel_size" not in from_args(environ=kubelet_env(one)).engine_kwargs()


def test_grace_period_shorter_than_the_drain_is_refused() -> None:
    message = helm_error({"worker": {"drainTimeoutSeconds": 60, "terminationGracePeriodSeconds": 30}})
    assert "terminationGracePeriodSeconds" in message and "mid-drain" in message


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_worker_rollout_needs_no_spare_gpu_and_has_a_pdb(value_set: str) -> None:
    docs = rendered(value_set)
    dep = deployment(docs, "worker")
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    if merged_values(value_set)["worker"]["pdb"]["enabled"]:
        pdbs = [
            p
            for p in find(docs, "PodDisruptionBudget")
            if p["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
        ]
        assert len(pdbs) == 1


def test_worker_scheduling_comes_from_values() -> None:
    values = values_of("all-on")
    spec = deployment(rendered("all-on"), "worker")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == values["worker"]["nodeSelector"]
    assert spec["tolerations"] == values["worker"]["tolerations"]
    assert spec["affinity"] == values["worker"]["affinity"]
    assert spec["runtimeClassName"] == "nvidia"
    default_spec = deployment(rendered("default"), "worker")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in default_spec[
        "tolerations"
    ]


# --- model sources ------------------------------------------------------------------------------------------


def test_model_baked_in_the_image_needs_no_volume() -> None:
    spec = deployment(rendered("default"), "worker")["spec"]["template"]["spec"]
    assert "initContainers" not in spec
    assert "model" not in {v["name"] for v in spec["volumes"]}
    # An unset SPECSERVE_MODEL makes the service load the demo model shipped in the image.
    assert "SPECSERVE_MODEL" not in env_of(spec["containers"][0])
    baked = deployment(tuple(render({"model": {"path": "/opt/models/llama"}})), "worker")
    assert env_of(container(baked, "worker"))["SPECSERVE_MODEL"] == "/opt/models/llama"


def test_model_from_a_pvc_is_mounted_read_only() -> None:
    spec = deployment(rendered("external-redis"), "worker")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "models-rox", "readOnly": True}
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "hf"}
    assert env_of(spec["containers"][0])["SPECSERVE_MODEL"] == "/models/Qwen2.5-7B-Instruct"


def test_model_copied_by_an_init_container_into_the_worker_volume() -> None:
    spec = deployment(rendered("all-on"), "worker")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model-source"]["persistentVolumeClaim"]["claimName"] == "model-store"
    assert "ephemeral" in volumes["model"]
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert init_mounts["model"]["mountPath"] == "/models" and not init_mounts["model"].get("readOnly")
    assert init_mounts["model-source"] == {"name": "model-source", "mountPath": "/source", "readOnly": True}
    assert env_of(init) == {"SOURCE": "/source", "TARGET": "/models"}
    worker = spec["containers"][0]
    (mount,) = [m for m in worker["volumeMounts"] if m["name"] == "model"]
    assert mount["readOnly"] is True
    env = env_of(worker)
    assert env["SPECSERVE_MODEL"].startswith(mount["mountPath"] + "/")
    assert env["SPECSERVE_SPEC_MODEL"].startswith(mount["mountPath"] + "/")
    assert env["SPECSERVE_SPEC_METHOD"] == "draft_model"


def test_engine_settings_reach_the_worker_as_env() -> None:
    env = env_of(container(deployment(rendered("all-on"), "worker"), "worker"))
    # 20 GiB must stay an integer: Helm reads numbers as float64 and would otherwise print 2.147483648e+10.
    assert env["SPECSERVE_KV_CACHE_BYTES"] == "21474836480"
    assert env["SPECSERVE_MAX_NUM_SEQS"] == "128"
    assert env["SPECSERVE_NUM_SPEC_TOKENS"] == "4"
    assert env["SPECSERVE_DTYPE"] == "bfloat16"
    assert env["SPECSERVE_HEALTH_PORT"] == "9001"
    default_env = env_of(container(deployment(rendered("default"), "worker"), "worker"))
    assert not {"SPECSERVE_KV_CACHE_BYTES", "SPECSERVE_MAX_NUM_SEQS", "SPECSERVE_NUM_SPEC_TOKENS"} & set(
        default_env
    )


# --- security -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_is_locked_down(value_set: str) -> None:
    specs = list(pod_specs(rendered(value_set)))
    assert len(specs) >= 3
    for where, spec in specs:
        assert spec["automountServiceAccountToken"] is False, where
        pod_ctx = spec["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True, where
        assert pod_ctx["runAsUser"] > 0, where
        assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for ctr in spec.get("initContainers", []) + spec["containers"]:
            ctx = ctr["securityContext"]
            label = f"{where}/{ctr['name']}"
            assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] > 0, label
            assert ctx["allowPrivilegeEscalation"] is False, label
            assert ctx["readOnlyRootFilesystem"] is True, label
            assert ctx["capabilities"] == {"drop": ["ALL"]}, label
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, label


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_read_only_containers_get_writable_scratch_space(value_set: str) -> None:
    docs = rendered(value_set)
    for component in ("api", "worker"):
        ctr = container(deployment(docs, component), component)
        mounts = {m["mountPath"] for m in ctr["volumeMounts"]}
        assert {"/tmp", "/cache"} <= mounts
        env = env_of(ctr)
        for variable in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HF_HOME", "CUDA_CACHE_PATH"):
            assert env[variable].startswith("/cache"), variable


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_no_secret_value_is_rendered_into_a_pod_spec(value_set: str) -> None:
    for where, spec in pod_specs(rendered(value_set)):
        for ctr in spec["containers"]:
            env = env_of(ctr)
            if "REDIS_URL" in env:
                password = urlsplit(env["REDIS_URL"]).password
                assert password in (None, "$(SPECSERVE_REDIS_PASSWORD)"), where
            if "SPECSERVE_API_KEYS" in env:
                assert "secretKeyRef" in env["SPECSERVE_API_KEYS"], where


# --- Redis: bundled Valkey or external, never both ----------------------------------------------------------


def test_bundled_valkey_is_one_replica_with_aof_on_a_pvc() -> None:
    docs = rendered("default")
    sts = one(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    valkey = sts["spec"]["template"]["spec"]["containers"][0]
    args = valkey["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--dir") + 1] == "/data"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert {"name": "data", "mountPath": "/data"} in valkey["volumeMounts"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    service = one(docs, "Service", f"{RELEASE}-specserve-valkey")
    url = urlsplit(env_of(container(deployment(docs, "worker"), "worker"))["REDIS_URL"])
    assert url.scheme == "redis" and url.hostname == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert url.port == 6379


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_workers_and_api_share_one_redis(value_set: str) -> None:
    docs = rendered(value_set)
    urls = {env_of(container(deployment(docs, c), c))["REDIS_URL"] for c in ("api", "worker")}
    prefixes = {env_of(container(deployment(docs, c), c))["SPECSERVE_PREFIX"] for c in ("api", "worker")}
    assert len(urls) == 1 and len(prefixes) == 1


def test_external_redis_renders_no_valkey_and_a_tls_url() -> None:
    docs = rendered("external-redis")
    assert find(docs, "StatefulSet") == []
    assert [d for d in docs if "valkey" in d["metadata"]["name"]] == []
    worker = container(deployment(docs, "worker"), "worker")
    env = env_of(worker)
    url = urlsplit(env["REDIS_URL"])
    assert (url.scheme, url.username, url.hostname, url.port, url.path) == (
        "rediss",
        "specserve",
        "master.llm-queue.abc123.use1.cache.amazonaws.com",
        6380,
        "/1",
    )
    assert env["SPECSERVE_REDIS_PASSWORD"]["secretKeyRef"] == {
        "name": "llm-queue-credentials",
        "key": "password",
    }
    # redis-py passes unknown URL query arguments to its SSL connection: the CA path reaches ssl_ca_certs.
    ca_path = url.query.removeprefix("ssl_ca_certs=")
    (mount,) = [m for m in worker["volumeMounts"] if m["name"] == "redis-ca"]
    (volume,) = [
        v
        for v in deployment(docs, "worker")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "redis-ca"
    ]
    assert volume["secret"]["secretName"] == "llm-queue-ca"
    (item,) = volume["secret"]["items"]
    assert ca_path == f"{mount['mountPath']}/{item['path']}"


@pytest.mark.parametrize(
    "redis",
    [
        {"mode": "bundled", "external": {"host": "redis.example.com"}},
        {"mode": "bundled", "external": {"existingSecret": "creds"}},
        {"mode": "external"},
        {"mode": "external", "external": {"host": ""}},
    ],
)
def test_ambiguous_or_incomplete_redis_choice_is_refused(redis: dict[str, Any]) -> None:
    assert "redis" in helm_error({"redis": redis})


# --- KEDA, HPA ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", ["all-on", "external-redis"])
def test_keda_triggers_watch_the_stream_and_group_the_workers_read(value_set: str) -> None:
    docs = rendered(value_set)
    dep = deployment(docs, "worker")
    env = env_of(container(dep, "worker"))
    scaled = one(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    assert "replicas" not in dep["spec"], (
        "KEDA owns the replica count; a rendered one fights it on every upgrade"
    )
    url = urlsplit(env["REDIS_URL"])
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    assert set(triggers) == {"queue-lag", "in-flight"}
    keys = Keys(from_args(environ=kubelet_env(container(dep, "worker"))).prefix)
    for trigger in triggers.values():
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["stream"] == keys.requests
        assert meta["consumerGroup"] == keys.group
        assert meta["address"] == f"{url.hostname}:{url.port}"
        assert meta["databaseIndex"] == url.path.strip("/")
    assert int(triggers["queue-lag"]["metadata"]["lagCount"]) >= 1
    assert "activationLagCount" in triggers["queue-lag"]["metadata"]
    assert int(triggers["in-flight"]["metadata"]["pendingEntriesCount"]) >= 1


@pytest.mark.parametrize("value_set", ["all-on", "external-redis"])
def test_keda_authenticates_like_the_workers(value_set: str) -> None:
    docs = rendered(value_set)
    scaled = one(docs, "ScaledObject")
    auth = one(docs, "TriggerAuthentication")
    env = env_of(container(deployment(docs, "worker"), "worker"))
    url = urlsplit(env["REDIS_URL"])
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert {k: refs["password"][k] for k in ("name", "key")} == env["SPECSERVE_REDIS_PASSWORD"][
        "secretKeyRef"
    ]
    rendered_secrets = {s["metadata"]["name"]: s["stringData"] for s in find(docs, "Secret")}
    for ref in refs.values():
        if ref["name"] in rendered_secrets:
            assert ref["key"] in rendered_secrets[ref["name"]]
    tls_in_trigger = {t["metadata"].get("enableTLS") == "true" for t in scaled["spec"]["triggers"]}
    tls_in_auth = "tls" in refs and rendered_secrets[refs["tls"]["name"]]["tls"] == "enable"
    assert (url.scheme == "rediss") == (tls_in_trigger == {True} or tls_in_auth)
    if url.username:
        assert rendered_secrets[refs["username"]["name"]][refs["username"]["key"]] == url.username


def test_an_external_cluster_gives_keda_the_tagged_stream_and_the_workers_their_seed_nodes() -> None:
    docs = rendered("external-cluster")
    dep = deployment(docs, "worker")
    env = env_of(container(dep, "worker"))
    cfg = from_args(environ=kubelet_env(container(dep, "worker")))
    keys = Keys(cfg.prefix, cluster=True)  # what the service names its keys on a cluster
    assert cfg.seed_nodes() == ["node-b.example.com:6379", "node-c.example.com:6380"]
    assert urlsplit(env["REDIS_URL"]).hostname == "clustercfg.example.com"
    for trigger in one(docs, "ScaledObject")["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-cluster-streams"
        assert (meta["stream"], meta["consumerGroup"]) == (keys.requests, keys.group)
        assert meta["addresses"].split(",") == [
            "clustercfg.example.com:6379",
            "node-b.example.com:6379",
            "node-c.example.com:6380",
        ]
        assert "address" not in meta and "databaseIndex" not in meta


def test_keda_is_off_by_default_and_workers_keep_their_replicas() -> None:
    docs = rendered("default")
    assert find(docs, "ScaledObject") == [] and find(docs, "TriggerAuthentication") == []
    assert deployment(docs, "worker")["spec"]["replicas"] == 1


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_api_hpa_targets_the_api(value_set: str) -> None:
    docs = rendered(value_set)
    dep = deployment(docs, "api")
    hpas = find(docs, "HorizontalPodAutoscaler")
    if merged_values(value_set)["api"]["autoscaling"]["enabled"]:
        (hpa,) = hpas
        assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
        assert "replicas" not in dep["spec"]
        assert container(dep, "api")["resources"]["requests"]["cpu"]
    else:
        assert hpas == [] and dep["spec"]["replicas"] >= 1


# --- API ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_api_service_probes_and_keys(value_set: str) -> None:
    docs = rendered(value_set)
    values = merged_values(value_set)
    dep = deployment(docs, "api")
    api = container(dep, "api")
    env = env_of(api)
    (port,) = api["ports"]
    assert port["containerPort"] == int(env["SPECSERVE_PORT"]) == values["api"]["port"]
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    service = one(docs, "Service", dep["metadata"]["name"])
    assert service["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    if values["api"]["auth"]["enabled"]:
        ref = env["SPECSERVE_API_KEYS"]["secretKeyRef"]
        if values["api"]["auth"]["existingSecret"]:
            assert ref["name"] == values["api"]["auth"]["existingSecret"]
            assert find(docs, "Secret", ref["name"]) == []
        else:
            (secret,) = find(docs, "Secret", ref["name"])
            assert secret["stringData"][ref["key"]]
    else:
        assert "SPECSERVE_API_KEYS" not in env
    # Auth off in values is the operator's explicit choice: the chart says so to the API, which otherwise
    # refuses to serve listenHost (not loopback) with no keys.
    allowed = env.get("SPECSERVE_ALLOW_UNAUTHENTICATED")
    assert allowed == (None if values["api"]["auth"]["enabled"] else "true")


def test_api_keys_from_values_are_comma_joined_and_roll_the_pods() -> None:
    docs = rendered("all-on")
    ref = env_of(container(deployment(docs, "api"), "api"))["SPECSERVE_API_KEYS"]["secretKeyRef"]
    assert (
        one(docs, "Secret", ref["name"])["stringData"]["keys"] == "sk-team-a-0123456789,sk-team-b-9876543210"
    )
    assert "checksum/api-keys" in deployment(docs, "api")["spec"]["template"]["metadata"]["annotations"]


def test_api_keys_from_an_existing_secret_render_no_secret() -> None:
    docs = render({"api": {"auth": {"existingSecret": "team-keys"}}})
    ref = env_of(container(deployment(tuple(docs), "api"), "api"))["SPECSERVE_API_KEYS"]["secretKeyRef"]
    assert ref == {"name": "team-keys", "key": "api-keys"}
    assert find(docs, "Secret", "team-keys") == []


def test_ingress_routes_to_the_api_service() -> None:
    docs = rendered("all-on")
    ingress = one(docs, "Ingress")
    service = one(docs, "Service", deployment(docs, "api")["metadata"]["name"])
    backends = [p["backend"]["service"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert backends and all(
        b == {"name": service["metadata"]["name"], "port": {"name": "http"}} for b in backends
    )
    assert ingress["spec"]["tls"][0]["secretName"] == "llm-example-com-tls"
    assert find(rendered("default"), "Ingress") == []


# --- observability, network ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_scrape_annotations_point_at_the_metrics_ports(value_set: str) -> None:
    docs = rendered(value_set)
    enabled = merged_values(value_set)["metrics"]["podAnnotations"]
    for component, port_name in (("api", "http"), ("worker", "health")):
        dep = deployment(docs, component)
        annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
        if not enabled:
            assert not [key for key in annotations if key.startswith("prometheus.io/")]
            continue
        (port,) = [p for p in container(dep, component)["ports"] if p["name"] == port_name]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port["containerPort"])
        assert annotations["prometheus.io/path"] == "/metrics"


def test_service_monitors_select_services_with_the_named_ports() -> None:
    docs = rendered("all-on")
    monitors = find(docs, "ServiceMonitor")
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in find(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
        pods = [
            d
            for d in find(docs, "Deployment")
            if d["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        ]
        assert len(pods) == 1
    assert find(rendered("default"), "ServiceMonitor") == []


def exported_metric_names(metrics_prefix: str = "specserve") -> set[str]:
    """Every sample name a worker's /metrics can hold, from a real Telemetry after one finished request."""
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.service.telemetry import Telemetry

    telemetry = Telemetry(metrics_prefix=metrics_prefix)
    try:
        telemetry.engine.model_name = "m"
        usage = {"prompt_tokens": 3, "completion_tokens": 4}
        telemetry.request_ended("m", "finished", "stop", usage, 1.0, 0.1, 0.01)
        telemetry.ttft.record(0.1)
        telemetry.queue_wait.record(0.1)
        telemetry.http_requests.add(1, {"route": "/v1/requests", "method": "POST", "code": 200})
        text = telemetry.metrics_text().decode()
    finally:
        telemetry.shutdown()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


# kube-state-metrics' restart counter: the one series the alerts read that specserve does not export.
KUBE_STATE_METRICS = {"kube_pod_container_status_restarts_total"}
METRIC_REF = re.compile(r"\b(specserve[:_][a-z0-9_:]+|kube_[a-z0-9_]+)")


def test_alerts_and_dashboard_read_only_metrics_the_service_exports() -> None:
    docs = rendered("all-on")
    exported = exported_metric_names() | KUBE_STATE_METRICS
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {
        "SpecserveBacklogAge",
        "SpecserveDeadLetters",
        "SpecserveWorkerRestarts",
        "SpecserveKVCacheSaturated",
    }
    dashboard = json.loads(one(docs, "ConfigMap", "llm-dashboard")["data"]["specserve.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "specserve.json").read_text())
    exprs = [r["expr"] for r in alerts.values()]
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        refs = set(METRIC_REF.findall(expr))
        assert refs and refs <= exported, (expr, refs - exported)
    # Every panel's series belongs to this release's namespace; the alerts to the release's own.
    assert all('namespace=~"$namespace"' in t["expr"] for p in dashboard["panels"] for t in p["targets"])
    assert all(f'namespace="{NAMESPACE}"' in e for e in exprs[: len(alerts)])
    # The dashboard charts vLLM's names under our prefix, and thresholds come from values.
    charted = {ref for e in exprs for ref in METRIC_REF.findall(e)}
    assert {
        "specserve:time_to_first_token_seconds_bucket",
        "specserve:kv_cache_usage_perc",
        "specserve:spec_decode_num_accepted_tokens_total",
        "specserve:request_success_total",
    } <= charted
    assert alerts["SpecserveBacklogAge"]["expr"].endswith("> 300")
    assert alerts["SpecserveKVCacheSaturated"]["expr"].endswith("> 0.95")
    assert 'pod=~"llm-worker-.*"' in alerts["SpecserveWorkerRestarts"]["expr"]
    for alert in alerts.values():  # Prometheus's templates reach Prometheus, not Helm
        assert "{{" not in alert["annotations"]["summary"]
    assert "{{ $labels.pod }}" in alerts["SpecserveKVCacheSaturated"]["annotations"]["description"]


def test_worker_logging_settings_reach_the_workers_config() -> None:
    """worker.accessLog and worker.logStatsIntervalSeconds, as the worker parses its environment."""
    on = from_args(environ=kubelet_env(container(deployment(rendered("all-on"), "worker"), "worker")))
    assert on.access_log is True and on.log_stats_interval == 30
    default = from_args(environ=kubelet_env(container(deployment(rendered("default"), "worker"), "worker")))
    assert default.access_log is False and default.log_stats_interval == 10


def test_prefix_routing_settings_reach_the_workers_config() -> None:
    off = from_args(environ=kubelet_env(container(deployment(rendered("all-on"), "worker"), "worker")))
    assert off.prefix_routing is False and off.prefix_routing_wait_ms == 80
    default = from_args(environ=kubelet_env(container(deployment(rendered("default"), "worker"), "worker")))
    assert default.prefix_routing is True and default.prefix_routing_wait_ms == 50
    assert default.worker_config().routing.enabled and default.worker_config().routing.wait_ms == 50


def test_alerts_and_dashboard_are_off_by_default() -> None:
    docs = rendered("default")
    assert find(docs, "PrometheusRule") == [] and find(docs, "ConfigMap", "rel-specserve-dashboard") == []


def test_otlp_endpoint_reaches_api_and_workers() -> None:
    docs = rendered("all-on")
    for component in ("api", "worker"):
        env = env_of(container(deployment(docs, component), component))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4318"
        assert env["OTEL_SERVICE_NAME"] == f"specserve-{component}"
        attributes = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
        assert attributes["deployment.environment"] == "production"
        assert attributes["specserve.component"] == component
        assert attributes["k8s.pod.name"] == "$(POD_NAME)"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_of(
        container(deployment(rendered("default"), "api"), "api")
    )


@pytest.mark.parametrize("value_set", ["default", "all-on"])
def test_only_api_workers_and_keda_reach_valkey(value_set: str) -> None:
    docs = rendered(value_set)
    sts = one(docs, "StatefulSet")
    (policy,) = [
        p
        for p in find(docs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    pod_peers = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p]
    expected = [deployment(docs, c)["spec"]["selector"]["matchLabels"] for c in ("api", "worker")]
    values = merged_values(value_set)
    extra = [p["podSelector"]["matchLabels"] for p in values["networkPolicy"]["redisExtraFrom"]]
    assert pod_peers == expected + extra
    namespaces = [p["namespaceSelector"]["matchLabels"] for p in rule["from"] if "namespaceSelector" in p]
    if values["worker"]["keda"]["enabled"]:
        assert namespaces == [{"kubernetes.io/metadata.name": values["worker"]["keda"]["operatorNamespace"]}]
    else:
        assert namespaces == []


def test_workers_accept_traffic_only_on_their_health_port() -> None:
    docs = rendered("all-on")
    dep = deployment(docs, "worker")
    (policy,) = [
        p
        for p in find(docs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    ]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9001}]
    assert rule["from"] == values_of("all-on")["networkPolicy"]["metricsFrom"]


def test_api_admits_clients_scrapers_and_the_helm_test_only() -> None:
    docs = rendered("all-on")
    values = values_of("all-on")["networkPolicy"]
    dep = deployment(docs, "api")
    (policy,) = [
        p
        for p in find(docs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    ]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    (test_pod,) = find(docs, "Pod")
    test_peer = {
        "podSelector": {
            "matchLabels": {
                k: test_pod["metadata"]["labels"][k]
                for k in (
                    "app.kubernetes.io/name",
                    "app.kubernetes.io/instance",
                    "app.kubernetes.io/component",
                )
            }
        }
    }
    assert rule["from"] == values["apiFrom"] + values["metricsFrom"] + [test_peer]


# --- the service reads what the chart writes ----------------------------------------------------------------

SERVICE_ENV = {f.metadata["env"] for f in fields(ServiceConfig) if f.metadata.get("env")}
# Set by the chart for the kubelet's $(...) expansion only, never read by the service.
CHART_ONLY_ENV = {"SPECSERVE_REDIS_PASSWORD"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
@pytest.mark.parametrize("component", ["api", "worker"])
def test_service_config_parses_the_rendered_environment(value_set: str, component: str) -> None:
    docs = rendered(value_set)
    values = merged_values(value_set)
    ctr = container(deployment(docs, component), component)
    env = kubelet_env(ctr)
    unknown = {name for name in env if name.startswith("SPECSERVE_")} - SERVICE_ENV - CHART_ONLY_ENV
    assert unknown == set(), "variables the service does not read (misspelt?)"
    cfg = from_args(environ=env)
    assert cfg.prefix == values["prefix"] and cfg.host == values["listenHost"]
    assert cfg.redis_url == env["REDIS_URL"]
    if component == "api":
        assert cfg.port == values["api"]["port"]
        assert bool(cfg.keys_list()) == values["api"]["auth"]["enabled"]
        check_api_exposure(cfg)  # the API starts: it would exit on a keyless public bind it was not allowed
        return
    assert cfg.health_port == values["worker"]["healthPort"]
    assert cfg.drain_timeout == values["worker"]["drainTimeoutSeconds"]
    assert cfg.dtype == values["engine"]["dtype"]
    assert cfg.device == ("cuda" if values["worker"]["gpu"]["count"] else "cpu")
    assert cfg.model == (values["model"]["path"] or None)
    assert cfg.speculative_method == values["engine"]["speculative"]["method"]
    assert cfg.kv_cache_bytes == values["engine"].get("kvCacheBytes")  # Helm drops null values


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_redis_url_carries_credentials_tls_and_db_to_the_client(value_set: str) -> None:
    docs = rendered(value_set)
    values = merged_values(value_set)
    env = kubelet_env(container(deployment(docs, "worker"), "worker"))
    client = connect(env["REDIS_URL"])  # the service's own client; nothing connects until a command runs
    kwargs = client.connection_pool.connection_kwargs
    external = values["redis"]["mode"] == "external"
    has_password = external and (
        values["redis"]["external"]["existingSecret"] or values["redis"]["external"]["password"]
    )
    assert kwargs.get("password") == (SECRET_VALUE if has_password or not external else None)
    assert kwargs["db"] == values["redis"]["db"]
    assert kwargs.get("username") == (values["redis"]["external"]["username"] or None if external else None)
    tls = external and values["redis"]["external"]["tls"]["enabled"]
    assert client.connection_pool.connection_class.__name__ == ("SSLConnection" if tls else "Connection")
    if tls and values["redis"]["external"]["tls"]["caSecret"]:
        assert kwargs["ssl_ca_certs"].startswith("/etc/specserve/redis-ca/")


def test_bundled_valkey_command_line_runs_and_exposes_what_keda_reads(tmp_path: Path) -> None:
    """Run the StatefulSet's own valkey-server arguments on a real server and use it as the chart wires it."""
    docs = tuple(render({"worker": {"keda": {"enabled": True}}}))
    valkey = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    env = kubelet_env(valkey)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in valkey["args"]]
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path)
    server = subprocess.Popen(
        [valkey_server_binary(), *args, "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    server.kill()
                    pytest.fail(f"valkey-server did not start: {server.communicate()[1].decode()[-2000:]}")
                time.sleep(0.02)
        with sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(256).startswith(b"-NOAUTH"), "the bundled Valkey answered without a password"
        worker_env = kubelet_env(container(deployment(docs, "worker"), "worker"))
        url = urlsplit(worker_env["REDIS_URL"])
        local_url = url._replace(netloc=f"{url.username or ''}:{url.password}@127.0.0.1:{port}").geturl()
        (lag_trigger, pending_trigger) = one(docs, "ScaledObject")["spec"]["triggers"]
        stream, group = lag_trigger["metadata"]["stream"], lag_trigger["metadata"]["consumerGroup"]
        assert (pending_trigger["metadata"]["stream"], pending_trigger["metadata"]["consumerGroup"]) == (
            stream,
            group,
        )

        async def scenario() -> tuple[dict[str, Any], dict[str, Any], int]:
            client = connect(local_url)
            try:
                config = await client.config_get("appendonly")
                config |= await client.config_get("maxmemory-policy")
                await client.xgroup_create(stream, group, id="0", mkstream=True)
                for i in range(3):
                    await client.xadd(stream, {"n": str(i)})
                before = (await client.xinfo_groups(stream))[0]
                await client.xreadgroup(group, "worker-0", {stream: ">"}, count=2)
                after = (await client.xinfo_groups(stream))[0]
                return config, before | {"after_lag": after["lag"]}, after["pending"]
            finally:
                await client.aclose()

        config, group_info, pending = asyncio.run(scenario())
        assert config == {"appendonly": "yes", "maxmemory-policy": "noeviction"}
        # queue-lag reads `lag` (entries no worker has been given); in-flight reads the pending entries.
        assert (group_info["lag"], group_info["after_lag"], pending) == (3, 1, 2)
        assert list(tmp_path.glob("appendonlydir/*.aof")), "AOF files are written to the data volume"
    finally:
        server.terminate()
        server.wait(timeout=10)


# --- values.schema.json and README --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"worker": {"replicas": -1}},
        {"api": {"replicas": -2}},
        {"engine": {"dtype": "fp8"}},
        {"engine": {"device": "tpu"}},
        {"engine": {"speculative": {"method": "medusa"}}},
        {"engine": {"speculative": {"method": "draft_model"}}},
        {"engine": {"maxNumSeqs": 0}},
        {"worker": {"gpu": {"count": 1.5}}},
        {"worker": {"healthPort": 70000}},
        {"worker": {"replica": 2}},
        {"worker": {"keda": {"enabled": "yes"}}},
        {"model": {"source": "s3"}},
        {"model": {"source": "pvc", "path": "/models/m"}},
        {"redis": {"mode": "cluster"}},
        {"redis": {"external": {"password": "p@ss:word"}}},
        {"redis": {"mode": "external", "db": 2, "external": {"host": "h", "cluster": {"enabled": True}}}},
        {"redis": {"external": {"cluster": {"seedNodes": ["no-port"]}}}},
        {"prefix": "has space"},
        {"api": {"auth": {"keys": ["a,b"]}}},
        {"metrics": {"serviceMonitor": {"interval": "soon"}}},
        {"metrics": {"prefix": "sglang"}},
        {"engine": {"maxModelLen": 0}},
        {"engine": {"quantization": "fp8"}},
        {"engine": {"tensorParallelSize": 0}},
        {"engine": {"toolCallParser": "mistral"}},
        {"model": {"servedModelName": "qwen"}},
        {"model": {"servedModelName": ["two words"]}},
    ],
)
def test_schema_refuses_invalid_values(bad: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)
    # ...and so does an install: rendering validates against the schema first.
    with pytest.raises(helm.HelmValuesError):
        render(bad)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_schema_accepts_the_shipped_values(value_set: str) -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values_of(value_set))


def value_paths(
    values: dict[str, Any], schema: dict[str, Any], defs: dict[str, Any], prefix: str = ""
) -> Iterator[str]:
    """Dotted paths of the documented values: structured objects are walked, free-form ones are leaves."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        sub = schema["properties"][key]
        if "$ref" in sub:
            sub = defs[sub["$ref"].rsplit("/", 1)[1]]
        if isinstance(value, dict) and sub.get("additionalProperties") is False and key != "resources":
            yield from value_paths(value, sub, defs, f"{path}.")
        else:
            yield path


def test_readme_documents_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, flags=re.MULTILINE))
    paths = set(value_paths(defaults, schema, schema["definitions"]))
    assert len(paths) > 100
    assert paths - documented == set(), "values missing from the README table"
    assert documented - paths == set(), "README documents values that do not exist"


# --- Dockerfiles (static: no Docker engine here) ------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    assert pending == "", "dangling line continuation"
    return [(ins.upper(), rest) for ins, _, rest in (line.partition(" ") for line in logical)]


# `pip install .` or `pip install ".[extra,...]"`: the project itself, not a dependency.
PROJECT_INSTALL = re.compile(r"""pip install (?:\.|"\.\[(?P<extras>[^\]]*)\]")(?=\s|$)""")


def project_extras(run: str) -> set[str] | None:
    """The extras a RUN installs the project with (empty: none), or None when it does not install it."""
    m = PROJECT_INSTALL.search(run)
    if m is None:
        return None
    return {e.strip() for e in (m["extras"] or "").split(",") if e.strip()}


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (ins, _) in enumerate(instructions) if ins == "FROM"]
    return instructions[starts[-1] :]


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_image_runs_the_cli_as_the_charts_non_root_user(name: str) -> None:
    instructions = dockerfile_instructions(ROOT / "docker" / name)
    stage = final_stage(instructions)
    users = [rest for ins, rest in stage if ins == "USER"]
    assert users, "the final stage must switch away from root"
    uid, _, gid = users[-1].partition(":")
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["securityContext"]
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd, and equal to the chart's.
    assert (int(uid), int(gid)) == (defaults["runAsUser"], defaults["runAsGroup"])
    (entrypoint,) = [json.loads(rest) for ins, rest in stage if ins == "ENTRYPOINT"]
    assert entrypoint[-1] == "specserve" and entrypoint[0].endswith("tini")
    (cmd,) = [json.loads(rest) for ins, rest in stage if ins == "CMD"]
    assert cmd[0] in {"serve", "worker", "api"}
    assert not [ins for ins, _ in stage if ins == "HEALTHCHECK"], "probes live in the chart, per subcommand"
    exposed = {int(p) for ins, rest in stage if ins == "EXPOSE" for p in rest.split()}
    assert exposed == {defaults_port("api", "port"), defaults_port("worker", "healthPort")}


def defaults_port(component: str, key: str) -> int:
    return yaml.safe_load((CHART / "values.yaml").read_text())[component][key]


@pytest.mark.parametrize(
    ("name", "index_suffix", "base"),
    [("Dockerfile.cuda", "/cu128", "nvidia/cuda:"), ("Dockerfile.cpu", "/cpu", "python:")],
)
def test_image_installs_torch_before_the_package(name: str, index_suffix: str, base: str) -> None:
    instructions = dockerfile_instructions(ROOT / "docker" / name)
    args = dict(rest.split("=", 1) for ins, rest in instructions if ins == "ARG" and "=" in rest)
    assert args["TORCH_INDEX_URL"].endswith(index_suffix)
    assert any(value.startswith(base) for value in args.values())
    runs = [rest for ins, rest in instructions if ins == "RUN"]
    torch_step = next(i for i, run in enumerate(runs) if '"${TORCH_SPEC}" --index-url' in run)
    package_step = next(i for i, run in enumerate(runs) if project_extras(run) is not None)
    assert torch_step < package_step
    copied = [
        rest.split()[:-1] for ins, rest in instructions if ins == "COPY" and not rest.startswith("--from")
    ]
    for sources in copied:
        for source in sources:
            assert (ROOT / source).exists(), f"{name} copies {source}, which is not in the repository"


@pytest.mark.parametrize(("name", "extras"), [("Dockerfile.cuda", {"gpu"}), ("Dockerfile.cpu", set())])
def test_only_the_cuda_image_installs_the_gpu_extra(name: str, extras: set[str]) -> None:
    # Triton is an optional dependency (the gpu extra): the CPU image must not carry it.
    runs = [rest for ins, rest in dockerfile_instructions(ROOT / "docker" / name) if ins == "RUN"]
    (installed,) = [e for e in map(project_extras, runs) if e is not None]
    assert installed == extras
    assert ("triton" in " ".join(runs)) == ("gpu" in extras)


def test_dockerignore_keeps_what_the_images_copy() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    ignored.discard("")
    for needed in ("pyproject.toml", "README.md", "specserve"):
        assert needed not in ignored
    assert {".git", "tests", "helm"} <= ignored


def test_cpu_image_can_build_the_attention_kernel() -> None:
    """CPU workers compile their C++ attention kernel on first use (-march=native for the CPU they run on):
    without a compiler in the final stage they would fall back to the torch ops, several times slower."""
    stage = final_stage(dockerfile_instructions(ROOT / "docker" / "Dockerfile.cpu"))
    installs = " ".join(rest for ins, rest in stage if ins == "RUN" and "apt-get install" in rest)
    assert "g++" in installs.split()


def test_queue_limits_and_fair_share_reach_the_api_and_the_workers_config() -> None:
    """queue.* and engine.schedulingPolicy, as each component parses its environment: the API checks the
    limits at enqueue, workers check raw XADDs against the same ones and run the ready queue's fair share."""
    docs = rendered("all-on")
    worker = from_args(environ=kubelet_env(container(deployment(docs, "worker"), "worker")))
    api = from_args(environ=kubelet_env(container(deployment(docs, "api"), "api")))
    for cfg in (worker, api):
        assert (cfg.max_backlog, cfg.tenant_max_queued, cfg.tenant_tokens_per_minute) == (
            100000,
            5000,
            2000000,
        )
    assert (
        worker.worker_config().fair_share.quantum == 256
        and worker.worker_config().fair_share.oldest_every == 4
    )
    assert worker.worker_config().limits.tenant_max_queued == 5000
    assert worker.scheduling_policy == "fcfs" and worker.background_tokens == 4
    default = from_args(environ=kubelet_env(container(deployment(rendered("default"), "worker"), "worker")))
    assert default.max_backlog == 0 and default.scheduling_policy == "priority"
    assert default.engine_kwargs()["background_tokens"] == 1  # the chart's value
    assert default.worker_config().fair_share.oldest_every == 8


# --- the engine's settings by vLLM's names ----------------------------------------------------------------


def test_vllm_flags_reach_the_workers_and_the_apis_config() -> None:
    docs = rendered("vllm-flags")
    worker = from_args(environ=kubelet_env(container(deployment(docs, "worker"), "worker")))
    kwargs = worker.engine_kwargs()
    assert kwargs["max_model_len"] == 8192 and kwargs["quantization"] == "int8"
    assert kwargs["tensor_parallel_size"] == 2
    assert worker.speculative_config() == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    assert worker.served_model_names() == ["qwen3", "qwen"]
    assert worker.worker_config().served_model_names == ("qwen3", "qwen")
    assert worker.metrics_prefix == "vllm"
    api = from_args(environ=kubelet_env(container(deployment(docs, "api"), "api")))
    assert api.tool_call_parser == "hermes"
    # the API learns the names from live workers (so a stopped worker's model leaves /v1/models), not from env
    assert api.served_model_names() == []
    default = from_args(environ=kubelet_env(container(deployment(rendered("default"), "worker"), "worker")))
    assert default.metrics_prefix == "specserve" and default.max_model_len is None
    assert default.quantization is None and default.served_model_names() == []


def test_a_tensor_parallel_size_other_than_the_gpu_count_is_refused() -> None:
    message = helm_error({"engine": {"tensorParallelSize": 2}})
    assert "engine.tensorParallelSize" in message and "worker.gpu.count" in message
    cpu = {"engine": {"tensorParallelSize": 2, "device": "cpu"}, "worker": {"gpu": {"count": 0}}}
    ranks = from_args(environ=kubelet_env(container(deployment(tuple(render(cpu)), "worker"), "worker")))
    assert ranks.tensor_parallel_size == 2  # CPU ranks share the pod's cores


@pytest.mark.parametrize("tag", ["0.2.0", "0.2.0-cuda", "0.2.0-cpu"])
def test_an_image_tag_gets_its_variant_suffix_once(tag: str) -> None:
    docs = tuple(render({"image": {"tag": tag}}))
    assert container(deployment(docs, "worker"), "worker")["image"] == "specserve:0.2.0-cuda"
    assert container(deployment(docs, "api"), "api")["image"] == "specserve:0.2.0-cpu"


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    (text,) = [text for name, text in out.items() if name.endswith("NOTES.txt")]
    return text


@pytest.mark.parametrize(
    "model, cache, warned",
    [
        ("Qwen/Qwen2.5-7B-Instruct", None, True),  # ~15 GB of bf16 weights, the default 10Gi cache
        ("meta-llama/Llama-3.1-70B-Instruct", "100Gi", True),
        ("Qwen/Qwen2.5-7B-Instruct", "20Gi", False),
        ("Qwen/Qwen3-0.6B", None, False),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "500Mi", False),
        ("acme/house-model", None, False),  # no size in the name: nothing to say
    ],
)
def test_notes_warn_when_a_hugging_face_model_will_not_fit_the_cache(
    model: str, cache: str | None, warned: bool
) -> None:
    values: dict[str, Any] = {"model": {"path": model}}
    if cache is not None:
        values["worker"] = {"cacheSizeLimit": cache}
    text = notes(values)
    assert ("worker.cacheSizeLimit" in text) == warned, text
    if warned:
        assert model in text


def test_notes_do_not_take_a_mounted_path_for_a_hugging_face_id() -> None:
    values = {"model": {"source": "pvc", "path": "/models/Qwen2.5-72B", "pvc": {"claimName": "m"}}}
    assert "cacheSizeLimit" not in notes(values)


def test_alerts_and_dashboard_follow_the_metrics_prefix() -> None:
    docs = rendered("vllm-flags")
    exported = exported_metric_names("vllm") | KUBE_STATE_METRICS
    rule = one(docs, "PrometheusRule")
    exprs = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    dashboard = json.loads(one(docs, "ConfigMap")["data"]["specserve.json"])
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    refs = {ref for e in exprs for ref in re.findall(r"\b(vllm:[a-z0-9_:]+|specserve[:_][a-z0-9_:]+)", e)}
    assert "vllm:kv_cache_usage_perc" in refs and "vllm:time_to_first_token_seconds_bucket" in refs
    assert dashboard["description"].startswith("specserve: ")  # the product's name stays where it is prose
    assert not {r for r in refs if r.startswith("specserve:")}
    assert refs - exported == set()


@pytest.mark.parametrize("value_set", ["all-on", "external-cluster"])
def test_sharded_queue_gives_keda_every_shards_stream_as_the_workers_name_it(value_set: str) -> None:
    values = values_of(value_set)
    values.setdefault("queue", {})["shards"] = 3
    docs = list(render(values))
    cfg = from_args(environ=kubelet_env(container(deployment(docs, "worker"), "worker")))
    assert cfg.queue_shards == 3
    keys = Keys(cfg.prefix, cluster=value_set == "external-cluster", shards=cfg.queue_shards)
    triggers = {t["name"]: t["metadata"] for t in one(docs, "ScaledObject")["spec"]["triggers"]}
    for shard in keys.every_shard():
        for name in (f"queue-lag-{shard.shard}", f"in-flight-{shard.shard}"):
            assert (triggers[name]["stream"], triggers[name]["consumerGroup"]) == (
                shard.requests,
                shard.group,
            )
    assert len(triggers) == 6
