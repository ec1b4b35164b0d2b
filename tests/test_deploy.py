"""`serve deploy` as an operator runs it: a Ray cluster started with `ray start --head`, the
shipped cluster/serve-config.yaml deployed with Ray's own CLI, asked through the openai client,
read with `serve status`, scaled 1 -> 2 engine replicas under load and back to 1 once idle, and
deployed again with another setting while streams run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from ddtree.config import ModelPairConfig, SamplingParams
from ddtree.engine import Engine

from .helpers import CHAT_SAMPLE, free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # its own cluster, started by `ray start`

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Ray starts clusters with token authentication; its CLI sends the token (~/.ray/auth_token)
# only when told to (README, "Deploying")
CLI_ENV = {**os.environ, "RAY_AUTH_MODE": "token"}
LONG = 96  # tokens of a stream that runs across a scale-up or a redeploy


def cli(*args: str, timeout: float = 300) -> str:
    done = subprocess.run([str(BIN / args[0]), *args[1:]], env=CLI_ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def wait_for(what: str, check, timeout: float) -> None:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"no {what} within {timeout:.0f} s"
        time.sleep(1)


def http_status(url: str) -> int:
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError:
        return 0


class Cluster:
    """A `ray start --head` cluster on 127.0.0.1 and the shipped Serve config deployed on it."""

    def __init__(self, model: Path, workdir: Path):
        self.dashboard_port, self.http_port, self.gcs_port = free_port(), free_port(), free_port()
        self.dashboard, self.base = f"http://127.0.0.1:{self.dashboard_port}", f"http://127.0.0.1:{self.http_port}"
        self.model, self.workdir = model, workdir
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)
        # in the foreground (--block), in a process group of its own, its files in a folder of its
        # own: stopping it (and ray.init elsewhere) never meets another cluster
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
        self.head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port",
             str(self.gcs_port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
             "--num-cpus", "4", "--disable-usage-stats", "--temp-dir", self.temp_dir],
            env=CLI_ENV, stdout=open(workdir / "ray-start.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for("Ray cluster answering `serve status`", lambda: self.head.poll() is None and subprocess.run(
            [str(BIN / "serve"), "status", "--address", self.dashboard], env=CLI_ENV, capture_output=True,
            timeout=60).returncode == 0, 180)

    def deploy(self, replicas: tuple[int, int] = (1, 2), **args) -> None:
        """`serve deploy` of cluster/serve-config.yaml with the tiny model, this cluster's port,
        short autoscaling delays between `replicas` (min, max) and `args` over its application's
        args."""
        config = yaml.safe_load((ROOT / "cluster" / "serve-config.yaml").read_text())
        config["http_options"]["port"] = self.http_port
        app = config["applications"][0]["args"]
        app.update(model=str(self.model), model_name="tiny", block_size=4, engine_num_cpus=1, **args)
        app["autoscaling"].update(min_replicas=replicas[0], max_replicas=replicas[1], target_ongoing_requests=1,
                                  upscale_delay_s=1,
                                  downscale_delay_s=3, metrics_interval_s=0.5, look_back_period_s=2)
        path = self.workdir / "serve-config.yaml"
        path.write_text(yaml.safe_dump(config))
        cli("serve", "deploy", str(path), "--address", self.dashboard)

    def status(self) -> dict:
        return yaml.safe_load(cli("serve", "status", "--address", self.dashboard, timeout=60))

    def engine_replicas(self) -> int:
        deployments = self.status()["applications"].get("ddtree", {}).get("deployments", {})
        return deployments.get("DDTreeEngine", {}).get("replica_states", {}).get("RUNNING", 0)  # (none mid-deploy)

    def stream(self, into: list, budget=64) -> None:
        """One streamed completion of LONG tokens; appends (text, finish_reason) or the error."""
        try:
            chunks = self.client.chat.completions.create(
                model="tiny", messages=CHAT_SAMPLE, max_tokens=LONG, temperature=0, stream=True,
                extra_body={"speculation": {"budget": budget}})
            text, finish = "", None
            for c in chunks:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
            into.append((text, finish))
        except Exception as err:  # noqa: BLE001 -- the test reports every failed stream
            into.append(err)

    def pids(self, title: str) -> list[int]:
        """This cluster's processes whose title starts with `title` (its own process session: the
        test run's other Ray cluster may run actors of the same names)."""
        ps = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout
        return [int(pid) for pid, sid, *cmd in (line.split(None, 2) for line in ps.splitlines())
                if int(sid) == self.head.pid and cmd and cmd[0].startswith(title)]

    def engine_pids(self) -> list[int]:
        return self.pids("ray::ServeReplica:ddtree:DDTreeEngine")

    def stop(self) -> None:
        subprocess.run([str(BIN / "serve"), "shutdown", "-y", "--address", self.dashboard], env=CLI_ENV,
                       capture_output=True, timeout=120)
        # every process of its session at once (a SIGTERM to `ray start --block` first waits 30 s
        # for the node to drain); `ray start` last, so that it reaps the processes it started
        for pid in self.pids(""):
            if pid != self.head.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(AssertionError):
            wait_for("the cluster's processes reaped", lambda: self.pids("") == [self.head.pid], 10)
        self.head.kill()
        self.head.wait(60)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tiny_chat_model, tmp_path_factory):
    running = Cluster(tiny_chat_model, tmp_path_factory.mktemp("deploy"))
    try:
        running.deploy()
        wait_for("healthy app", lambda: http_status(running.base + "/health") == 200, 300)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def expected(tiny_chat_model) -> dict[int, str]:
    """The in-process engine's greedy text of CHAT_SAMPLE at 16, LONG and 200 tokens."""
    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4))
    return {n: engine.generate([engine.request(engine.render_chat(CHAT_SAMPLE), n, SamplingParams())])[0].text
            for n in (16, LONG, 200)}


def test_serve_deploy_of_the_shipped_config_scales_and_serves_plain_decoding(cluster, expected):
    """Deployed with `serve deploy` on a `ray start --head` cluster (token authentication, as Ray
    starts it), the shipped config serves the in-process engine's text through the openai
    client; `serve status` says RUNNING; waves of six long streams bring a second engine replica,
    every stream's text still the in-process engine's; idle, it goes back to one replica."""
    reply = cluster.client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == expected[16]
    assert cluster.status()["applications"]["ddtree"]["status"] == "RUNNING"
    assert cluster.engine_replicas() == 1

    results: list = []
    peak = 1
    for _ in range(6):  # waves of load until the second replica runs
        streams = [threading.Thread(target=cluster.stream, args=(results,)) for _ in range(6)]
        for t in streams:
            t.start()
        while any(t.is_alive() for t in streams):
            peak = max(peak, cluster.engine_replicas())
            time.sleep(0.5)
        if peak == 2:
            break
    assert peak == 2, "a second engine replica under load"
    assert results and all(r == (expected[LONG], "length") for r in results), results
    wait_for("scale-down to one replica", lambda: cluster.engine_replicas() == 1, 180)
    reply = cluster.client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == expected[16]


def test_a_redeploy_with_another_default_budget_loses_no_stream(cluster, expected):
    """`serve deploy` of a changed config (another default budget) while four clients stream
    back to back, from before the deploy until the new replicas serve: every stream ends whole
    (its full text, finish "length", no error) -- in-flight streams finish on the old replicas
    -- and once the new replicas serve, requests run at the new default, with the same text."""
    results: list = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            cluster.stream(results, None)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for t in clients:
        t.start()
    try:
        wait_for("streams running", lambda: len(results) >= 4, 120)
        before = len(results)
        cluster.deploy(budget=0)

        def new_default() -> bool:
            reply = cluster.client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=16,
                                                           temperature=0)
            assert reply.choices[0].message.content == expected[16]
            return reply.usage.model_dump()["speculation"]["budget"] == 0

        wait_for("the redeployed default budget", new_default, 300)
        during = len(results) - before
        time.sleep(2)  # and a little past it
    finally:
        stop.set()
        for t in clients:
            t.join(300)
    assert during >= 4, "streams ran through the redeploy"
    assert all(r == (expected[LONG], "length") for r in results), [r for r in results if r != (expected[LONG], "length")]
    wait_for("the app RUNNING again", lambda: cluster.status()["applications"]["ddtree"]["status"] == "RUNNING", 300)
    print(f"\n{len(results)} streams, {during} of them from the deploy to the new default, all whole")


def read_sse(url: str, body: dict, into: list, started: threading.Event) -> None:
    """One raw SSE stream: appends {"text", "finish", "error", "done"} once it ends."""
    text, finish, error, done = "", None, None, False
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            if text:
                started.set()
    into.append({"text": text, "finish": finish, "error": error, "done": done})


def start_streams(url: str, body: dict, n: int) -> tuple[list[threading.Thread], list[dict], list[threading.Event]]:
    """`n` SSE streams of `body` in threads: (the threads, their results as they end, one event
    each set once its first text arrived)."""
    results: list[dict] = []
    started = [threading.Event() for _ in range(n)]
    streams = [threading.Thread(target=read_sse, args=(url, body, results, s)) for s in started]
    for t in streams:
        t.start()
    return streams, results, started


def test_a_killed_engine_replica_ends_only_its_own_streams_with_an_error(cluster, expected):
    """Two engine replicas under eight long streams; one replica's process is killed mid-stream.
    Only the streams it served end with an error event (then [DONE]) -- never cut short without
    one, never a wrong token; the others finish whole with plain decoding's text; new requests
    succeed on the survivor at once; the killed replica is replaced."""
    cluster.deploy(replicas=(2, 2), budget=0)
    wait_for("two engine replicas", lambda: cluster.engine_replicas() == 2 and len(cluster.engine_pids()) == 2, 300)
    plain = expected[200]
    # the untrained drafter at budget 64: one token per 65-row verify, slow on purpose
    body = {"model": "tiny", "messages": CHAT_SAMPLE, "max_tokens": 200, "temperature": 0, "stream": True,
            "speculation": {"budget": 64}}
    streams, results, started = start_streams(cluster.base + "/v1/chat/completions", body, 8)
    assert all(s.wait(120) for s in started), "every stream under way"
    victim = cluster.engine_pids()[0]
    os.kill(victim, signal.SIGKILL)
    after = [cluster.client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=16, temperature=0)
             for _ in range(4)]  # new requests, at once
    for t in streams:
        t.join(300)
    whole = [r for r in results if r["error"] is None]
    cut = [r for r in results if r["error"] is not None]
    assert len(results) == 8 and all(r["done"] for r in results), results
    assert all(r["text"] == plain and r["finish"] == "length" for r in whole), whole
    assert cut, "the killed replica was serving some streams"
    assert all(plain.startswith(r["text"]) and r["finish"] is None for r in cut), cut  # no wrong token
    assert whole, "the survivor's streams finished"
    assert all(a.choices[0].message.content == expected[16] for a in after)
    wait_for("the killed replica replaced",
             lambda: cluster.engine_replicas() == 2 and victim not in cluster.engine_pids(), 300)
    print(f"\nkilled one of two engine replicas under 8 streams: {len(cut)} ended with an error event, "
          f"{len(whole)} finished whole; 4 new requests served at once")


def test_the_data_plane_outlives_its_controller_and_recovers_from_a_killed_proxy(cluster, expected):
    """Serve's controller killed while streams run: the proxy and replicas keep serving (every
    stream whole, new requests answered while it is gone), and a new controller answers
    `serve status` again. The HTTP proxy killed: requests fail only until Serve starts another,
    within a bound (stated), and then are answered with plain decoding's text."""
    body = {"model": "tiny", "messages": CHAT_SAMPLE, "max_tokens": LONG, "temperature": 0, "stream": True}
    streams, results, started = start_streams(cluster.base + "/v1/chat/completions", body, 4)
    assert all(s.wait(120) for s in started), "every stream under way"
    [controller] = cluster.pids("ray::ServeController")
    os.kill(controller, signal.SIGKILL)
    killed = time.monotonic()
    replies = [cluster.client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=16, temperature=0)
               for _ in range(4)]  # while the controller is gone or restarting
    for t in streams:
        t.join(300)
    assert all(r["done"] and r["error"] is None and r["text"] == expected[LONG] for r in results), results
    assert all(r.choices[0].message.content == expected[16] for r in replies)
    wait_for("a new controller", lambda: subprocess.run(
        [str(BIN / "serve"), "status", "--address", cluster.dashboard], env=CLI_ENV, capture_output=True,
        timeout=60).returncode == 0 and controller not in cluster.pids("ray::ServeController"), 300)
    controller_s = time.monotonic() - killed

    [proxy] = cluster.pids("ray::ProxyActor")
    os.kill(proxy, signal.SIGKILL)
    killed = time.monotonic()

    def answered() -> bool:
        try:
            reply = cluster.client.with_options(timeout=10).chat.completions.create(
                model="tiny", messages=CHAT_SAMPLE, max_tokens=16, temperature=0)
        except openai.APIError:
            return False
        assert reply.choices[0].message.content == expected[16]
        return True

    wait_for("requests answered after the proxy was killed", answered, 180)
    proxy_s = time.monotonic() - killed
    print(f"\ncontroller killed: streams and requests served throughout, `serve status` back in {controller_s:.1f} s; "
          f"proxy killed: requests answered again in {proxy_s:.1f} s")
