"""deploy/: the Kustomize recipes render and validate offline, their metric names exist, the Dockerfiles lint.

Each overlay is rendered with ``kubectl kustomize``. Core objects are checked against the
Kubernetes OpenAPI schemas that ``kubernetes-validate`` ships (strict: unknown fields fail);
the KEDA ScaledObject and the ServiceMonitor against the schemas @kubernetes-models generates
from KEDA's and prometheus-operator's Go API types (``deploy/k8s/schema-check``, run with node;
these accept unknown fields). No package ships the LeaderWorkerSet schema: only its two pod
templates are checked, as core PodTemplates. Each validator is shown a broken copy it must refuse.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import requests
import yaml

from tests.deploy_metrics import exported_metric_names, metric_names_used_in_deploy
from tests.fake_engine import FakeEngine, RunningServer

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMA_CHECK = K8S / "schema-check"
OVERLAYS = ["hpa", "keda", "tpu", "tpu-multihost"]
# Oldest release the manifests need: the preStop sleep action is on by default from 1.30.
KUBERNETES_VERSION = "1.30"
DRAIN_TIMEOUT_S = 30
FLUSH_S = 2  # after the drain, the server's wait for handlers to write their last chunks (serve.py)

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the recipes cannot be rendered")


def kustomize(directory: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(directory)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Recipe name -> its objects: the base, each overlay, and keda with the GPU component."""
    recipes = {"base": kustomize(K8S / "base")}
    recipes.update({name: kustomize(K8S / "overlays" / name) for name in OVERLAYS})
    # kustomize takes only relative paths, and a component only from a kustomization.
    with_gpu = tmp_path_factory.mktemp("keda-gpu")
    (with_gpu / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays" / "keda", with_gpu)],
        "components": [os.path.relpath(K8S / "components" / "keda-gpu-trigger", with_gpu)],
    }))
    recipes["keda+gpu"] = kustomize(with_gpu)
    return recipes


def one(objects: list[dict], kind: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """Role -> PodTemplateSpec of the Deployment, or of the LeaderWorkerSet's leader and workers."""
    templates = {}
    for o in objects:
        if o["kind"] == "Deployment":
            templates["server"] = o["spec"]["template"]
        elif o["kind"] == "LeaderWorkerSet":
            lws = o["spec"]["leaderWorkerTemplate"]
            templates["leader"] = lws["leaderTemplate"]
            templates["worker"] = lws["workerTemplate"]
    return templates


def core_validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def as_pod_template(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}


@pytest.fixture(scope="module")
def crd_checker(tmp_path_factory):
    """Runs deploy/k8s/schema-check/check.mjs on a list of objects; its npm packages are cached."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to check the KEDA and prometheus-operator schemas")
    lock = (SCHEMA_CHECK / "package-lock.json").read_bytes()
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    directory = cache_root / "jaxinfer-tests" / f"crd-schema-check-{hashlib.sha256(lock).hexdigest()[:16]}"
    if not (directory / "node_modules" / ".package-lock.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(SCHEMA_CHECK / name, directory / name)
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=directory, check=True,
                       capture_output=True, timeout=300)
    # The script resolves its imports from its own folder, so it runs beside node_modules.
    shutil.copy(SCHEMA_CHECK / "check.mjs", directory / "check.mjs")

    def check(objects: list[dict]) -> list[str | None]:
        out = subprocess.run(["node", "check.mjs"], cwd=directory, input=json.dumps(objects), check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return json.loads(out)

    return check


@needs_kubectl
def test_every_object_validates_against_its_schema(rendered, crd_checker):
    for recipe, objects in rendered.items():
        by_crd = []
        for obj in objects:
            if obj["kind"] in ("ScaledObject", "ServiceMonitor"):
                by_crd.append(obj)
            elif obj["kind"] == "LeaderWorkerSet":
                for template in pod_templates([obj]).values():
                    core_validate(as_pod_template(template))
            else:
                core_validate(obj)
        results = crd_checker(by_crd)
        assert results == [None] * len(by_crd), (recipe, results)
    kinds = {o["kind"] for objects in rendered.values() for o in objects}
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor",
                     "HorizontalPodAutoscaler", "ScaledObject", "LeaderWorkerSet"}


@needs_kubectl
def test_broken_copies_fail_validation(rendered, crd_checker):
    deployment = copy.deepcopy(one(rendered["base"], "Deployment"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        core_validate(deployment)
    misspelt = copy.deepcopy(one(rendered["base"], "Deployment"))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        core_validate(misspelt)
    worker = copy.deepcopy(pod_templates(rendered["tpu-multihost"])["worker"])
    worker["spec"]["containers"][0]["args"] = "serve"
    with pytest.raises(kubernetes_validate.ValidationError):
        core_validate(as_pod_template(worker))

    scaled_object = copy.deepcopy(one(rendered["keda"], "ScaledObject"))
    scaled_object["spec"]["pollingInterval"] = "15s"
    no_trigger_type = copy.deepcopy(one(rendered["keda"], "ScaledObject"))
    del no_trigger_type["spec"]["triggers"][0]["type"]
    monitor = copy.deepcopy(one(rendered["base"], "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["port"] = 8000
    results = crd_checker([scaled_object, no_trigger_type, monitor])
    assert all(results), results
    assert "pollingInterval" in results[0] and "type" in results[1] and "port" in results[2]


def container_args(template: dict) -> dict[str, str]:
    [container] = template["spec"]["containers"]
    flags = {}
    for arg in container["args"][1:]:
        name, _, value = arg.partition("=")
        flags[name] = value
    return flags


@needs_kubectl
def test_pods_probe_drain_and_expose_the_server(rendered):
    for recipe, objects in rendered.items():
        templates = pod_templates(objects)
        config_maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
        for role, template in templates.items():
            spec = template["spec"]
            [container] = spec["containers"]
            flags = container_args(template)
            assert container["args"][0] == "serve" and flags["--host"] == "0.0.0.0", (recipe, role)
            assert float(flags["--drain-timeout"]) == DRAIN_TIMEOUT_S
            pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            if role == "worker":  # alive until the leader has drained and stopped it
                leader = templates["leader"]["spec"]["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
                assert pre_stop > leader + DRAIN_TIMEOUT_S + FLUSH_S
                assert spec["terminationGracePeriodSeconds"] > pre_stop
            else:
                assert spec["terminationGracePeriodSeconds"] > pre_stop + DRAIN_TIMEOUT_S + FLUSH_S, (recipe, role)
            # Generated ConfigMaps get a hash suffix: every reference must carry it.
            for c in spec["containers"] + spec.get("initContainers", []):
                for source in c.get("envFrom", []):
                    assert source["configMapRef"]["name"] in config_maps, (recipe, role)
            if role == "worker":  # followers serve no HTTP
                assert not {"startupProbe", "readinessProbe", "livenessProbe"} & container.keys()
                continue
            probes = {kind: container[kind]["httpGet"]["path"]
                      for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
            assert probes == {"startupProbe": "/live", "readinessProbe": "/health", "livenessProbe": "/live"}
            assert {p["containerPort"] for p in container["ports"] if p["name"] == "http"} == {int(flags["--port"])}


@needs_kubectl
def test_accelerators_per_recipe(rendered):
    def resources(template):
        return template["spec"]["containers"][0]["resources"]["limits"]

    for recipe in ("base", "hpa", "keda"):
        assert resources(pod_templates(rendered[recipe])["server"])["nvidia.com/gpu"] == 1
    tpu = pod_templates(rendered["tpu"])["server"]
    assert "nvidia.com/gpu" not in resources(tpu) and resources(tpu)["google.com/tpu"] == 4
    assert tpu["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2"
    assert one(rendered["tpu"], "ConfigMap")["data"]["TENSOR_PARALLEL_SIZE"] == "4"

    lws = one(rendered["tpu-multihost"], "LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    chips = 0
    for role, template in pod_templates(rendered["tpu-multihost"]).items():
        x, y = template["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x")
        chips = int(x) * int(y)
        assert resources(template)["google.com/tpu"] * size == chips, role
        flags = container_args(template)
        assert flags["--coordinator-address"] == "$(LWS_LEADER_ADDRESS):8476"
        assert flags["--num-processes"] == "$(LWS_GROUP_SIZE)" and flags["--process-id"] == "$(PROCESS_ID)"
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert len(env["TPU_WORKER_HOSTNAMES"].split(",")) == size
    assert one(rendered["tpu-multihost"], "ConfigMap")["data"]["TENSOR_PARALLEL_SIZE"] == str(chips)
    assert not [o for o in rendered["tpu-multihost"] if o["kind"] == "Deployment"]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@needs_kubectl
def test_selectors_and_scale_targets_match(rendered):
    for recipe, objects in rendered.items():
        service = one(objects, "Service")
        templates = pod_templates(objects)
        serving = {role for role, t in templates.items() if selects(service["spec"]["selector"], t["metadata"]["labels"])}
        assert serving == ({"leader"} if recipe == "tpu-multihost" else {"server"}), recipe
        pdb = one(objects, "PodDisruptionBudget")
        assert all(selects(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"]) for t in templates.values())
        monitor = one(objects, "ServiceMonitor")
        assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    deployment_name = one(rendered["base"], "Deployment")["metadata"]["name"]
    assert one(rendered["hpa"], "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == deployment_name
    scaled = one(rendered["keda"], "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == deployment_name
    # vLLM production stack's KEDA defaults; fallback needs every trigger to be AverageValue.
    assert (scaled["pollingInterval"], scaled["cooldownPeriod"]) == (15, 360)
    assert scaled["fallback"]["replicas"] >= scaled["minReplicaCount"]
    queue = {t["name"]: t for t in scaled["triggers"]}["queue"]
    assert queue["metadata"]["threshold"] == "5"
    for triggers in (scaled["triggers"], one(rendered["keda+gpu"], "ScaledObject")["spec"]["triggers"]):
        assert {t["metricType"] for t in triggers} == {"AverageValue"}
    assert len(one(rendered["keda+gpu"], "ScaledObject")["spec"]["triggers"]) == len(scaled["triggers"]) + 1


@pytest.fixture(scope="module")
def exported_names() -> set[str]:
    """Metric family and sample names a running server exports, on this machine (no GPU)."""
    with RunningServer(FakeEngine()) as s:
        r = requests.post(s.base_url + "/v1/completions", json={"model": s.model, "prompt": "the cat", "max_tokens": 2},
                          timeout=30)
        assert r.status_code == 200
        return exported_metric_names(requests.get(s.base_url + "/metrics", timeout=30).text)


def test_every_metric_named_in_deploy_is_exported(exported_names):
    """An autoscaler or a panel on a metric the server does not export never moves (the Ray
    ingress's /metrics is held to the same list: tests/test_ray_serve.py)."""
    used = metric_names_used_in_deploy()
    for needed in ("jaxinfer:num_requests_waiting", "jaxinfer:kv_cache_usage_perc", "jaxinfer:gpu_utilization_perc",
                   "jaxinfer:gpu_temperature_celsius", "jaxinfer:gpu_power_watts"):
        assert needed in used
    assert used - exported_names == set()


@needs_kubectl
def test_hpa_metric_is_what_the_adapter_rule_serves(rendered, exported_names):
    """The custom metrics API takes no ':'; the adapter rule renames, the HPA asks for the new name."""
    rules = yaml.safe_load((K8S / "overlays" / "hpa" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    served = set()
    for rule in rules:
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
        assert series in exported_names
        name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${", "\\g<").replace("}", ">"), series)
        assert ":" not in name
        served.add(name)
    hpa = one(rendered["hpa"], "HorizontalPodAutoscaler")
    asked = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert asked == {"jaxinfer_num_requests_waiting"} and asked <= served


class FakeNvml:
    """pynvml's calls the collector makes, for two GPUs; ``fail_on`` names the GPU whose power read raises."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, fail_on: int | None = None):
        self.fail_on = fail_on

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 40 + handle

    def nvmlDeviceGetPowerUsage(self, handle):
        if handle == self.fail_on:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return 350_000  # milliwatts

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=75)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=2**30)


def gpu_families(nvml) -> dict[str, list[tuple[dict, float]]]:
    from jaxinfer.server.device_metrics import DeviceCollector

    collector = DeviceCollector()
    collector._nvml = nvml
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in collector.collect()
            if f.name.startswith("jaxinfer:gpu_")}


def test_device_gauges_are_declared_everywhere_with_samples_only_from_nvml(exported_names):
    gpu_names = {"jaxinfer:gpu_utilization_perc", "jaxinfer:gpu_temperature_celsius", "jaxinfer:gpu_power_watts",
                 "jaxinfer:gpu_memory_used_bytes"}
    assert gpu_names | {"jaxinfer:device_memory_used_bytes"} <= exported_names
    assert gpu_families(None) == {name: [] for name in gpu_names}
    families = gpu_families(FakeNvml())
    assert families["jaxinfer:gpu_power_watts"] == [({"gpu": "0"}, 350.0), ({"gpu": "1"}, 350.0)]
    assert families["jaxinfer:gpu_temperature_celsius"] == [({"gpu": "0"}, 40), ({"gpu": "1"}, 41)]
    assert families["jaxinfer:gpu_utilization_perc"][0] == ({"gpu": "0"}, 0.75)
    # A read that fails leaves no partial set of samples behind, and /metrics still renders.
    assert gpu_families(FakeNvml(fail_on=1)) == {name: [] for name in gpu_names}


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfiles_pass_hadolint(tmp_path):
    for name in ("Dockerfile", "Dockerfile.cpu"):
        result = hadolint(DEPLOY / "docker" / name)
        assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text((DEPLOY / "docker" / "Dockerfile.cpu").read_text().replace(
        "FROM python:3.12-slim-bookworm\n", "FROM python:latest\n"))
    result = hadolint(broken)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_dockerfiles_run_unprivileged_with_a_health_check():
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (DEPLOY / "docker" / name).read_text()
        final_stage = text[text.rindex("\nFROM "):]
        assert "\nUSER 10001\n" in final_stage and "/health" in final_stage
        assert 'ENTRYPOINT ["jaxinfer-entrypoint"]' in final_stage
        # .dockerignore is an allow-list: a COPY of anything it leaves out fails the build.
        for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.MULTILINE):
            assert set(line.split()[:-1]) <= allowed, line
    entrypoint = (DEPLOY / "docker" / "entrypoint.sh").read_text()
    assert entrypoint.index("jaxinfer fetch") < entrypoint.index("exec jaxinfer serve")
