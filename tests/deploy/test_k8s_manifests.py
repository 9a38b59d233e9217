"""The Kubernetes manifests (deploy/k8s): every overlay renders with `kubectl kustomize`, every object
validates against the Kubernetes 1.32 schemas (kubernetes-validate, strict: unknown fields fail) or,
for KubeRay and prometheus-operator objects, against deploy/k8s/schema/ (written from KubeRay v1's
API types) with their pod templates validated as Kubernetes PodTemplateSpecs; the objects fit each
other (selectors, ports, claims, the RayJob's cluster, the threepo config of the entrypoint).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
K8S_VERSION = "1.32.0"  # the machine's kubectl client (v1.32, kustomize v5.5)
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
OWN_SCHEMAS = {"RayCluster": "raycluster", "RayJob": "rayjob", "PodMonitor": "podmonitor"}
GROUPS = ("learner", "sampler", "verifier")

needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not on PATH: the manifests are rendered with `kubectl kustomize` "
                            "(kubectl ships on the project's machine image; install kubectl >= 1.32 to run these)")
pytestmark = needs_kubectl


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    import yaml

    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(objects, kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@functools.cache
def own_schema(name: str) -> dict:
    return json.loads((K8S / "schema" / f"{name}.schema.json").read_text())


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(where, PodTemplateSpec) of every pod an object makes."""
    if obj["kind"] == "RayCluster":
        spec = obj["spec"]
        return [("head", spec["headGroupSpec"]["template"])] + [
            (g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    if obj["kind"] == "RayJob":
        return [("submitter", obj["spec"]["submitterPodTemplate"])] if "submitterPodTemplate" in obj["spec"] else []
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [(obj["metadata"]["name"], obj["spec"]["template"])]
    return []


def validate(obj: dict) -> None:
    """Raise if `obj` does not fit its schema (Kubernetes 1.32 strict, or our own for CRDs)."""
    import jsonschema
    import kubernetes_validate

    if obj["kind"] in OWN_SCHEMAS:
        jsonschema.Draft202012Validator(own_schema(OWN_SCHEMAS[obj["kind"]])).validate(obj)
        for where, template in pod_templates(obj):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": where}, "template": template}
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def ray_start_resources(value: str) -> dict:
    """The custom resources `ray start --resources=<value>` gets from KubeRay's shell command line."""
    words = shlex.split(value)
    assert len(words) == 1, f"rayStartParams.resources must be one shell word, got {words}"
    return json.loads(words[0])


def test_the_overlays_are_there():
    assert {"cpu-smoke", "gpu", "cpu-smoke-resume", "gpu-resume"} <= set(OVERLAYS), OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(overlay):
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"RayCluster", "RayJob", "PodMonitor", "Deployment", "Service", "NetworkPolicy",
            "PersistentVolumeClaim", "ConfigMap"} <= kinds, kinds
    for obj in objects:
        try:
            validate(obj)
        except Exception as e:  # one line: the object, the field's path, the validator's message
            where = "/".join(str(p) for p in getattr(e, "absolute_path", ()))
            message = str(getattr(e, "message", e))[:500]
            pytest.fail(f"overlays/{overlay}: {obj['kind']} {obj['metadata']['name']} invalid at "
                        f"{where or '(top)'}: {message}", pytrace=False)


def _broken_objects():
    """(what, object) pairs each of which must be rejected."""
    objects = render("gpu")
    cluster, job = one(objects, "RayCluster"), one(objects, "RayJob")
    monitor, deployment = one(objects, "PodMonitor", "threepo-ray-workers"), one(objects, "Deployment")

    def broken(obj, edit):
        obj = copy.deepcopy(obj)
        edit(obj)
        return obj

    return [
        ("misspelled workerGroupSpecs", broken(cluster, lambda o: o["spec"].update(
            workerGroupSpec=o["spec"].pop("workerGroupSpecs")))),
        ("missing groupName", broken(cluster, lambda o: o["spec"]["workerGroupSpecs"][1].pop("groupName"))),
        ("missing headGroupSpec", broken(cluster, lambda o: o["spec"].pop("headGroupSpec"))),
        ("replicas as a string", broken(cluster, lambda o: o["spec"]["workerGroupSpecs"][1].update(replicas="4"))),
        ("rayStartParams value not a string", broken(cluster, lambda o: o["spec"]["headGroupSpec"][
            "rayStartParams"].update({"num-cpus": 0}))),
        ("misspelled autoscalerOptions.version", broken(cluster, lambda o: o["spec"]["autoscalerOptions"].update(
            versoin=o["spec"]["autoscalerOptions"].pop("version")))),
        ("unknown autoscaler version", broken(cluster, lambda o: o["spec"]["autoscalerOptions"].update(version="v3"))),
        ("misspelled field in a pod template", broken(cluster, lambda o: o["spec"]["workerGroupSpecs"][0][
            "template"]["spec"].update(containres=[]))),
        ("GPU limit in the wrong place", broken(cluster, lambda o: o["spec"]["workerGroupSpecs"][1]["template"][
            "spec"]["containers"][0].update({"nvidia.com/gpu": 1}))),
        ("RayJob without entrypoint", broken(job, lambda o: o["spec"].pop("entrypoint"))),
        ("RayJob with both clusterSelector and rayClusterSpec", broken(job, lambda o: o["spec"].update(
            rayClusterSpec=cluster["spec"]))),
        ("RayJob shutdownAfterJobFinishes with clusterSelector", broken(job, lambda o: o["spec"].update(
            shutdownAfterJobFinishes=True))),
        ("unknown submissionMode", broken(job, lambda o: o["spec"].update(submissionMode="K8sJob"))),
        ("PodMonitor endpoint without port", broken(monitor, lambda o: o["spec"]["podMetricsEndpoints"][0].pop("port"))),
        ("PodMonitor misspelled relabelings", broken(monitor, lambda o: o["spec"]["podMetricsEndpoints"][0].update(
            relabellings=o["spec"]["podMetricsEndpoints"][0].pop("relabelings")))),
        ("Deployment misspelled replicas", broken(deployment, lambda o: o["spec"].update(
            replica=o["spec"].pop("replicas")))),
        ("Deployment container without image name type", broken(deployment, lambda o: o["spec"]["template"][
            "spec"]["containers"][0].update(image=["threepo"]))),
    ]


def test_the_schemas_reject_broken_objects():
    accepted = []
    for what, obj in _broken_objects():
        try:
            validate(obj)
        except Exception:
            continue
        accepted.append(what)
    assert not accepted, f"schemas accepted broken objects: {accepted}"


def _constraint_pin(package: str) -> str:
    text = (ROOT / "deploy" / "docker" / "constraints.txt").read_text()
    return re.search(rf"^{package}==(\S+)$", text, re.M).group(1)


def _dockerfile_uid() -> int:
    return int(re.search(r"useradd --uid (\d+)", (ROOT / "deploy" / "docker" / "Dockerfile").read_text()).group(1))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_cluster_topology(overlay):
    cluster = one(render(overlay), "RayCluster")
    spec = cluster["spec"]
    assert spec["rayVersion"] == _constraint_pin("ray"), "rayVersion must equal the images' Ray pin"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["version"] == "v2"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert tuple(groups) == GROUPS, "overlay patches address the groups by index in this order"
    for name, g in groups.items():
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], (name, g)
    assert groups["learner"]["minReplicas"] == groups["learner"]["maxReplicas"], "the learner group is fixed"
    assert ray_start_resources(groups["sampler"]["rayStartParams"]["resources"]) == {"threepo_sampler": 1}
    assert all("resources" not in groups[g]["rayStartParams"] for g in ("learner", "verifier"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_pod_exports_metrics_mounts_runs_and_is_not_root(overlay):
    objects = render(overlay)
    cluster = one(objects, "RayCluster")
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    entry = _entrypoint(objects)
    params = [cluster["spec"]["headGroupSpec"]["rayStartParams"]] + [
        g["rayStartParams"] for g in cluster["spec"]["workerGroupSpecs"]]
    assert all(p["metrics-export-port"] == "8080" for p in params)
    for where, template in pod_templates(cluster):
        pod = template["spec"]
        container = pod["containers"][0]
        assert {"name": "metrics", "containerPort": 8080} in container["ports"], where
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        runs = volumes[mounts[entry["runs_dir"]]]
        assert runs["persistentVolumeClaim"]["claimName"] in claims, where
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", where
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] == _dockerfile_uid() == pod["securityContext"]["fsGroup"], where
        assert container["image"] not in ("threepo-ray", "threepo-sandbox"), f"{where}: image not set by the overlay"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_where_the_overlay_says(overlay):
    groups = {g["groupName"]: g for g in one(render(overlay), "RayCluster")["spec"]["workerGroupSpecs"]}

    def gpus(group):
        return int(groups[group]["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))

    if overlay.startswith("gpu"):
        for group in ("learner", "sampler"):
            pod = groups[group]["template"]["spec"]
            assert gpus(group) >= 1, group
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert pod["nodeSelector"], group
        assert gpus("verifier") == 0
    else:
        assert all(gpus(g) == 0 for g in GROUPS)
        assert all("tolerations" not in groups[g]["template"]["spec"] for g in GROUPS)


def _entrypoint(objects) -> dict:
    """The RayJob's entrypoint parsed as the `threepo` CLI would: recipe, resume, overrides."""
    words = shlex.split(one(objects, "RayJob")["spec"]["entrypoint"])
    assert words[:2] == ["threepo", "train"], words
    parsed = {"recipe": None, "resume": None, "overrides": [], "words": words}
    rest = iter(words[2:])
    for word in rest:
        if word in ("--config", "--resume"):
            parsed[word[2:].replace("config", "recipe")] = next(rest)
        else:
            assert not word.startswith("-"), f"unexpected option {word}"
            parsed["overrides"].append(word)
    values = dict(o.split("=", 1) for o in parsed["overrides"])
    parsed["runs_dir"] = values.get("runs_dir")
    return parsed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayjob_runs_threepo_on_that_cluster(overlay):
    from threepo.deploy.config import load_config

    objects = render(overlay)
    cluster, job = one(objects, "RayCluster"), one(objects, "RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert job["metadata"].get("namespace") == cluster["metadata"].get("namespace")
    entry = _entrypoint(objects)
    known = [o for o in entry["overrides"] if not o.startswith("verifier.")]
    cfg = load_config(entry["recipe"], known)  # raises naming the key on a misspelled override
    assert cfg.runtime.ray_address == "auto" and cfg.runs_dir == entry["runs_dir"] == "/runs"


def test_rayjob_verifier_and_sandbox_overrides_are_valid_config():
    from threepo.deploy.config import load_config

    for overlay in OVERLAYS:
        objects = render(overlay)
        entry = _entrypoint(objects)
        cfg = load_config(entry["recipe"], entry["overrides"])
        service = one(objects, "Service", "threepo-sandbox")
        assert cfg.sandbox.endpoints == (f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}",)
        assert dict(cfg.verifier.route) == {"code_output": "remote_sandbox", "code_tests": "remote_sandbox"}, \
            "code rows go to the sandbox service, not to bubblewrap in the verifier pods"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_rayjob_is_labelled_run(overlay):
    """The README applies everything but the run first (`-l 'app.kubernetes.io/component!=run'`)."""
    labelled = [(o["kind"], o["metadata"]["name"]) for o in render(overlay)
                if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "run"]
    assert labelled == [("RayJob", "threepo-train")]


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.endswith("-resume")])
def test_resume_overlay_is_its_overlay_plus_resume_auto(overlay):
    fresh, resumed = render(overlay.removesuffix("-resume")), render(overlay)
    assert _entrypoint(resumed)["words"] == _entrypoint(fresh)["words"] + ["--resume", "auto"]
    assert _entrypoint(fresh)["resume"] is None
    strip = [o for o in resumed if o["kind"] != "RayJob"]
    assert strip == [o for o in fresh if o["kind"] != "RayJob"], "a resume changes only the RayJob"


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sandbox_service_is_isolated(overlay):
    objects = render(overlay)
    cluster = one(objects, "RayCluster")
    deployment, service = one(objects, "Deployment", "threepo-sandbox"), one(objects, "Service", "threepo-sandbox")
    policy = one(objects, "NetworkPolicy", "threepo-sandbox")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"][:3] == ["python", "-m", "threepo.services.verifiers.sandbox_server"]
    assert container["command"][container["command"].index("--host") + 1] == "0.0.0.0"
    port = int(container["command"][container["command"].index("--port") + 1])
    assert {"name": "http", "containerPort": port} in container["ports"]
    assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert _matches(policy["spec"]["podSelector"]["matchLabels"], pod["metadata"]["labels"])
    assert "Egress" in policy["spec"]["policyTypes"] and not policy["spec"].get("egress"), "no egress at all"
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"ray.io/cluster": cluster["metadata"]["name"]}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["image"] != "threepo-sandbox"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_podmonitors_scrape_the_ray_metrics_ports(overlay):
    objects = render(overlay)
    cluster = one(objects, "RayCluster")
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    node_types = set()
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector["ray.io/cluster"] == cluster["metadata"]["name"]
        node_type = selector["ray.io/node-type"]
        node_types.add(node_type)
        templates = [t for where, t in pod_templates(cluster) if (where == "head") == (node_type == "head")]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for template in templates:
                names = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
                assert endpoint["port"] in names, (monitor["metadata"]["name"], endpoint["port"])
            targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
            assert targets["ray_io_cluster"] == ["__meta_kubernetes_pod_label_ray_io_cluster"]
        assert monitor["metadata"]["labels"]["release"]
    assert node_types == {"head", "worker"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_configmap_is_the_generated_file(overlay):
    config_map = one(render(overlay), "ConfigMap", "threepo-grafana-dashboard")
    text = (K8S / "base" / "dashboards" / "threepo.json").read_text()
    assert config_map["data"] == {"threepo.json": text}
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    # kubectl apply keeps the object in an annotation limited to 256 KiB
    assert len(json.dumps(config_map)) < 200_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (apt-get install -y bubblewrap)")
def test_sandbox_readiness_probe_passes_against_the_real_server(tmp_path):
    """The probe's program, run against the real sandbox server, succeeds; with no server it fails."""
    probe = one(render("gpu"), "Deployment", "threepo-sandbox")["spec"]["template"]["spec"]["containers"][0][
        "readinessProbe"]["exec"]["command"]
    port = _free_port()
    command = [sys.executable if probe[0] == "python" else probe[0]] + [w.replace(":8080/", f":{port}/") for w in probe[1:]]
    assert command != probe[1:]
    env = dict(os.environ, THREEPO_SANDBOX_TOKEN="")
    server = subprocess.Popen([sys.executable, "-m", "threepo.services.verifiers.sandbox_server", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
            if result.returncode == 0 or time.monotonic() > deadline or server.poll() is not None:
                break
            time.sleep(0.5)
        assert result.returncode == 0, result.stderr[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    failed = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert failed.returncode != 0
