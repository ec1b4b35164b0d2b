"""Dashboards, Prometheus and deployment manifests.

A real Prometheus (Debian's package, installed by `make test`) scrapes the real Serve app on
127.0.0.1 while a short load runs; every PromQL expression of the dashboard must then return at
least one series through Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import jsonschema
import openai
import pytest
import yaml

from ddtree.dashboards.ddtree_dashboard import (
    DASHBOARD_UID,
    DATASOURCE_UID,
    PANELS,
    build_dashboard,
    dashboard_json,
    promql_expressions,
)
from ddtree.dashboards.grafana import GrafanaAuth
from ddtree.serve.config import ServeConfig

from .helpers import CHAT_SAMPLE, MODEL, free_port

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "tests" / "data" / "k8s"  # KubeRay CRD schemas, SOURCES.md there


# --- the dashboard as code ------------------------------------------------------------------


def test_every_panel_has_a_unit_and_a_description():
    model = dashboard_json()
    assert len(model["panels"]) == len(PANELS) >= 9
    for panel in model["panels"]:
        assert panel["description"], panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == DATASOURCE_UID for t in panel["targets"])
    names = [v["name"] for v in model["templating"]["list"]]
    assert names == ["application", "deployment", "replica"]


def test_dashboard_round_trips_through_json():
    """The SDK's own model accepts its JSON back (from_json) and writes the same JSON again."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    first = dashboard_json()
    again = json.loads(json.dumps(Dashboard.from_json(first), cls=JSONEncoder))
    assert again == first
    assert build_dashboard().build().uid == DASHBOARD_UID


def test_export_command_writes_the_dashboard(tmp_path):
    out = tmp_path / "ddtree.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "dashboards", "export", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == dashboard_json()


def test_grafana_auth_flags_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("GRAFANA_URL", "http://grafana-from-env:3000")
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_env")
    assert GrafanaAuth.from_env().credential() == "glsa_env"
    auth = GrafanaAuth.from_env(url="http://grafana:3000", token="glsa_flag")
    assert (auth.url, auth.credential()) == ("http://grafana:3000", "glsa_flag")
    monkeypatch.delenv("GRAFANA_TOKEN")
    assert GrafanaAuth.from_env(user="admin", password="pw").credential() == ("admin", "pw")
    monkeypatch.delenv("GRAFANA_URL")
    with pytest.raises(ValueError, match="GRAFANA_URL"):
        GrafanaAuth.from_env()


class GrafanaStandIn(BaseHTTPRequestHandler):
    """The five routes of Grafana's HTTP API that `dashboards push` and the check below use,
    with Grafana's rules: a second data source of the same uid or name is a 409; a dashboard
    posted without a uid gets a new one; one posted over an existing uid without `overwrite`
    (and without its stored version) is a 412; each save bumps the version."""

    state: dict  # set per server: {"datasources": {uid: body}, "dashboards": {uid: body}, "requests": [...]}

    def log_message(self, *args):
        pass

    def answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def route(self, method: str) -> None:
        path, _, query = self.path.partition("?")
        self.state["requests"].append((method, path, self.headers.get("Authorization")))
        sources, boards = self.state["datasources"], self.state["dashboards"]
        uid = path.removeprefix("/api/datasources/uid/") if path.startswith("/api/datasources/uid/") else None
        if method == "GET" and uid is not None:
            return self.answer(200, sources[uid]) if uid in sources else self.answer(404, {"message": "Data source not found"})
        if method == "PUT" and uid is not None:
            if uid not in sources:
                return self.answer(404, {"message": "Data source not found"})
            sources[uid] = {**self.body(), "id": sources[uid]["id"], "uid": uid}
            return self.answer(200, {"message": "Datasource updated", "datasource": sources[uid]})
        if method == "POST" and path == "/api/datasources":
            source = self.body()
            if source.get("uid") in sources or any(s["name"] == source["name"] for s in sources.values()):
                return self.answer(409, {"message": "data source with the same name already exists"})
            sources[source["uid"]] = {**source, "id": len(sources) + 1}
            return self.answer(200, {"message": "Datasource added", "datasource": sources[source["uid"]]})
        if method == "POST" and path == "/api/dashboards/db":
            payload = self.body()
            board = dict(payload["dashboard"])
            board["uid"] = board.get("uid") or f"generated-{len(boards) + 1}"
            stored = boards.get(board["uid"])
            if stored and not payload.get("overwrite") and board.get("version") != stored["version"]:
                return self.answer(412, {"status": "version-mismatch", "message": "The dashboard has been changed by someone else"})
            board["version"] = stored["version"] + 1 if stored else 1
            boards[board["uid"]] = {**board, "folderUid": payload.get("folderUid")}
            return self.answer(200, {"status": "success", "uid": board["uid"], "version": board["version"]})
        if method == "GET" and path == "/api/search":
            words = parse_qs(query).get("query", [""])[0].lower()
            return self.answer(200, [{"uid": u, "title": b["title"], "type": "dash-db"} for u, b in boards.items() if words in b["title"].lower()])
        return self.answer(404, {"message": "Not found"})

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_PUT(self):
        self.route("PUT")


@pytest.fixture
def grafana():
    """A Grafana HTTP API stand-in on 127.0.0.1 (the real push code and grafana-client talk to it
    over HTTP); yields its URL and what it stores."""
    state = {"datasources": {}, "dashboards": {}, "requests": []}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (GrafanaStandIn,), {"state": state}))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{httpd.server_address[1]}", **state}
    httpd.shutdown()
    httpd.server_close()


def test_push_twice_leaves_one_dashboard_and_one_data_source(grafana):
    """`ddtree dashboards push` creates, then updates in place: pushing again (here with a new
    Prometheus URL) overwrites the dashboard of the same uid and updates the data source of the
    same uid, instead of failing on them or adding a second of either."""
    from grafana_client import GrafanaApi

    from ddtree.dashboards.grafana import push

    auth = GrafanaAuth(grafana["url"], token="glsa_test")
    first = push(auth, "http://prometheus:9090", folder_uid="llm")
    second = push(auth, "http://prometheus-2:9090", folder_uid="llm")
    assert (first["uid"], first["version"]) == (DASHBOARD_UID, 1)
    assert (second["uid"], second["version"]) == (DASHBOARD_UID, 2)
    assert list(grafana["dashboards"]) == [DASHBOARD_UID]
    stored = grafana["dashboards"][DASHBOARD_UID]
    assert stored["folderUid"] == "llm" and stored["panels"] == dashboard_json()["panels"]
    assert list(grafana["datasources"]) == [DATASOURCE_UID]
    source = grafana["datasources"][DATASOURCE_UID]
    assert (source["id"], source["type"], source["url"]) == (1, "prometheus", "http://prometheus-2:9090")
    assert {auth for *_, auth in grafana["requests"]} == {"Bearer glsa_test"}
    found = GrafanaApi.from_url(auth.url, credential=auth.credential()).search.search_dashboards(query="ddtree")
    assert [d["uid"] for d in found] == [DASHBOARD_UID]


@pytest.mark.skipif(not os.environ.get("GRAFANA_URL"), reason="set GRAFANA_URL (and GRAFANA_TOKEN or GRAFANA_USER/PASSWORD) to push to a real Grafana")
def test_push_twice_leaves_one_dashboard():
    from grafana_client import GrafanaApi

    from ddtree.dashboards.grafana import push

    auth = GrafanaAuth.from_env()
    push(auth, "http://127.0.0.1:9090")
    push(auth, "http://127.0.0.1:9090")
    api = GrafanaApi.from_url(auth.url, credential=auth.credential())
    found = api.search.search_dashboards(query="ddtree")
    assert [d["uid"] for d in found].count(DASHBOARD_UID) == 1


# --- Prometheus scraping the real app ---------------------------------------------------------


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends for a panel or variable: variables -> match-all, $__rate_interval -> 1m,
    label_values(m, l) -> a query that has series exactly when the variable has values."""
    expr = expr.replace("$__rate_interval", "1m")
    expr = re.sub(r"\$(application|deployment|replica)", ".*", expr)
    match = re.fullmatch(r"label_values\((.*), (\w+)\)", expr)
    if match:
        return f"count by ({match.group(2)}) ({match.group(1)})"
    return expr


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "the prometheus binary is missing: `make test` installs Debian's prometheus package"
    work = tmp_path_factory.mktemp("prometheus")
    # the shipped config, pointed at a service-discovery file in Ray's own format
    config = yaml.safe_load((ROOT / "cluster" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "2s"
    job = config["scrape_configs"][0]
    job["file_sd_configs"][0]["files"] = [str(work / "ray_targets.json")]
    job["file_sd_configs"][0]["refresh_interval"] = "2s"
    metrics_target = server["metrics"].removeprefix("http://").removesuffix("/metrics")
    (work / "ray_targets.json").write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [metrics_target]}]))
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def short_load(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    for i in range(4):
        client.chat.completions.create(model=MODEL, messages=CHAT_SAMPLE, max_tokens=8, temperature=0)
        stream = client.chat.completions.create(model=MODEL, messages=CHAT_SAMPLE, max_tokens=8, stream=True, seed=i)
        for _ in stream:
            pass
    accepting = openai.OpenAI(base_url=base + "/accepting/v1", api_key="unused", max_retries=0)
    accepting.chat.completions.create(model="accepting", messages=CHAT_SAMPLE, max_tokens=9, temperature=0,
                                      extra_body={"speculation": {"budget": "chain"}})
    accepting.chat.completions.create(model="accepting", messages=CHAT_SAMPLE, max_tokens=9, temperature=0,
                                      extra_body={"speculation": {"budget": "auto"}})  # the policy's panels
    accepting.chat.completions.create(model="accepting", messages=CHAT_SAMPLE, max_tokens=9, temperature=0,
                                      extra_body={"speculation": {"budget": 8, "lookup": True}})
    for _ in range(3):  # errors for the error panel
        httpx.post(base + "/v1/chat/completions", json={"model": "nope", "messages": CHAT_SAMPLE}, timeout=60)


@pytest.mark.slow
def test_every_dashboard_query_returns_series(server, prometheus):
    exprs = [grafana_to_promql(e) for e in promql_expressions()]
    empty = exprs
    deadline = time.time() + 150
    while time.time() < deadline and empty:
        short_load(server["base"])
        time.sleep(4)
        empty = []
        for expr in exprs:
            answer = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=30).json()
            assert answer["status"] == "success", (expr, answer)
            if not answer["data"]["result"]:
                empty.append(expr)
    assert not empty, "queries without a series:\n" + "\n".join(empty)


# --- manifests --------------------------------------------------------------------------------


def crd_schema(kind: str) -> dict:
    path = CRDS / f"ray.io_{kind.lower()}s.yaml"
    crd = yaml.safe_load(path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def manifests():
    for path in sorted((ROOT / "cluster" / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("apiVersion", "").startswith("ray.io/"):
                yield path.name, doc


@pytest.mark.parametrize("name,doc", list(manifests()), ids=[n for n, _ in manifests()])
def test_kuberay_manifests_validate_against_the_crds(name, doc):
    from ray.serve.schema import ServeDeploySchema

    jsonschema.validate(doc, crd_schema(doc["kind"]))
    if doc["kind"] == "RayService":
        serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
        schema = ServeDeploySchema.model_validate(serve_config)
        for app in schema.applications:
            assert app.import_path == "ddtree.serve.app:build_app"
            ServeConfig.model_validate(app.args)


def test_cpu_rayservice_runs_the_serve_deploy_config():
    """The CPU sample's serveConfigV2 holds the same application as cluster/serve-config.yaml."""
    local = yaml.safe_load((ROOT / "cluster" / "serve-config.yaml").read_text())
    service = yaml.safe_load((ROOT / "cluster" / "kuberay" / "rayservice-cpu.yaml").read_text())
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["applications"] == local["applications"]


@pytest.mark.parametrize("name", ["rayservice-gpu-nvlink", "rayservice-gpu-pcie"])
def test_gpu_rayservices_use_the_placement_the_planner_chooses(name):
    """Each GPU sample records its node and load in `ddtree.io/plan`; the planner, run on the
    recorded topology of such a node, must choose the sample's tp and replicas per node."""
    from ddtree.cluster.placement import GIB, Footprint, plan
    from ddtree.cluster.topology import Topology

    service = yaml.safe_load((ROOT / "cluster" / "kuberay" / f"{name}.yaml").read_text())
    recorded = dict(kv.split("=") for kv in service["metadata"]["annotations"]["ddtree.io/plan"].split())
    topology = Topology.parse((ROOT / "tests" / "data" / "topology" / f"{recorded['topology']}.txt").read_text())
    hf = json.loads((ROOT / "tests" / "data" / "models" / "qwen3-8b.json").read_text())
    chosen = plan(Footprint.from_hf_config(hf, 2, GIB, int(recorded["kv-tokens"])), int(recorded["gpu-memory-gib"]) * GIB, topology)
    assert (chosen.tp, chosen.pp, len(chosen.replicas)) == (int(recorded["tp"]), 1, int(recorded["replicas-per-node"]))
    args = ServeConfig.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus_per_node = int(workers["rayStartParams"]["num-gpus"])
    assert args.tp == chosen.tp and args.device == "cuda"
    assert args.autoscaling.max_replicas == len(chosen.replicas) == gpus_per_node // (chosen.tp * chosen.pp)
    assert args.engine_num_gpus == (1 if chosen.tp == 1 else 0)  # at tp > 1 the placement group holds the GPUs


def test_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (`make test` installs it)"
    proc = subprocess.run([promtool, "check", "config", str(ROOT / "cluster" / "prometheus.yml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
