"""`serve deploy` as an operator runs it: a Ray cluster started with `ray start --head`, the
shipped cluster/serve-config.yaml deployed with Ray's own CLI, asked through the openai client,
read with `serve status`, scaled 1 -> 2 engine replicas under load and back to 1 once idle."""

from __future__ import annotations

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


def cli(*args: str, timeout: float = 300) -> str:
    done = subprocess.run([str(BIN / args[0]), *args[1:]], env=CLI_ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def engine_replicas(dashboard: str) -> int:
    status = yaml.safe_load(cli("serve", "status", "--address", dashboard, timeout=60))
    states = status["applications"]["ddtree"]["deployments"]["DDTreeEngine"]["replica_states"]
    return states.get("RUNNING", 0)


def wait_for(what: str, check, timeout: float) -> None:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"no {what} within {timeout:.0f} s"
        time.sleep(1)


def test_serve_deploy_of_the_shipped_config_scales_and_serves_plain_decoding(tiny_chat_model, tmp_path):
    """The shipped config with the tiny model, short autoscaling delays and a free port: deployed
    with `serve deploy` on a `ray start --head` cluster (token authentication, as Ray starts
    it), it serves the in-process engine's text through the openai client; `serve status` says
    RUNNING; six long streams at once bring a second engine replica, and every stream's text is
    still the in-process engine's; idle, it goes back to one replica."""
    dashboard_port, http_port, gcs_port = free_port(), free_port(), free_port()
    dashboard, base = f"http://127.0.0.1:{dashboard_port}", f"http://127.0.0.1:{http_port}"
    config = yaml.safe_load((ROOT / "cluster" / "serve-config.yaml").read_text())
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    args.update(model=str(tiny_chat_model), model_name="tiny", block_size=4, engine_num_cpus=1)
    args["autoscaling"].update(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=1,
                               downscale_delay_s=3, metrics_interval_s=0.5, look_back_period_s=2)
    deployed = tmp_path / "serve-config.yaml"
    deployed.write_text(yaml.safe_dump(config))

    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4))
    expected = {n: engine.generate([engine.request(engine.render_chat(CHAT_SAMPLE), n, SamplingParams())])[0].text
                for n in (16, 96)}

    # a cluster of its own: in the foreground (--block) in a process group of its own, and its
    # files in a folder of its own, so stopping it (and ray.init elsewhere) never meets another
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port), "--num-cpus", "4",
         "--disable-usage-stats", "--temp-dir", temp_dir],
        env=CLI_ENV, stdout=open(tmp_path / "ray-start.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("Ray cluster answering `serve status`", lambda: head.poll() is None and subprocess.run(
            [str(BIN / "serve"), "status", "--address", dashboard], env=CLI_ENV, capture_output=True,
            timeout=60).returncode == 0, 180)
        cli("serve", "deploy", str(deployed), "--address", dashboard)
        wait_for("healthy app", lambda: _status(base + "/health") == 200, 300)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == expected[16]
        status = yaml.safe_load(cli("serve", "status", "--address", dashboard, timeout=60))
        assert status["applications"]["ddtree"]["status"] == "RUNNING", status
        assert engine_replicas(dashboard) == 1

        texts: list[str] = []

        def stream():
            chunks = client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=96, temperature=0,
                                                    stream=True, extra_body={"speculation": {"budget": 64}})
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

        peak = 1
        for _ in range(6):  # waves of load until the second replica runs
            streams = [threading.Thread(target=stream) for _ in range(6)]
            for t in streams:
                t.start()
            while any(t.is_alive() for t in streams):
                peak = max(peak, engine_replicas(dashboard))
                time.sleep(0.5)
            if peak == 2:
                break
        assert peak == 2, "a second engine replica under load"
        assert texts and all(t == expected[96] for t in texts)
        wait_for("scale-down to one replica", lambda: engine_replicas(dashboard) == 1, 180)
        reply = client.chat.completions.create(model="tiny", messages=CHAT_SAMPLE, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == expected[16]
    finally:
        subprocess.run([str(BIN / "serve"), "shutdown", "-y", "--address", dashboard], env=CLI_ENV,
                       capture_output=True, timeout=120)
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError:
        return 0
