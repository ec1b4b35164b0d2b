"""`ddtree generate` as a user runs it: a real subprocess on the default model pair."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddtree.config import SamplingParams

CLI = [sys.executable, "-m", "ddtree.cli", "generate"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.smollm2
def test_generate_json_lines_and_budget_invariance():
    prompts = ["What is the capital of France?", "Name three primary colors."]
    outputs = {}
    for budget in ("0", "16"):
        proc = run("--budget", budget, "--max-tokens", "12", "--json", *sum((["--prompt", p] for p in prompts), []))
        assert proc.returncode == 0, proc.stderr
        lines = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [line["prompt"] for line in lines] == prompts
        for line in lines:
            assert {"text", "tokens", "rounds", "tau", "tokens_per_s", "finish_reason"} <= set(line)
            assert 1 <= len(line["tokens"]) <= 12 and line["text"]
        outputs[budget] = [line["tokens"] for line in lines]
    assert outputs["0"] == outputs["16"], "greedy output does not depend on the budget"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--budget", "-3"], "budget must be >= 0"),
        (["--budget", "wide"], "non-negative integer, 'chain' or 'auto'"),
        (["--temperature", "-0.5"], "--temperature: Input should be greater than or equal to 0"),
        (["--top-p", "1.5"], "--top-p: Input should be less than or equal to 1"),
        (["--max-tokens", "0"], "max-tokens"),
        (["--tp", "0"], "--tp: Input should be greater than or equal to 1"),
        # a rule over two fields: its error has no field to name (it once crashed the CLI)
        (["--cuda-graphs", "on", "--tp", "2"], "cuda_graphs 'on' captures the in-process engine's forward"),
    ],
)
def test_bad_arguments_get_a_clear_error(args, message):
    proc = run("--prompt", "hi", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.ray  # in the `ddtree generate` subprocess
def test_generate_with_tp2_runs_the_distributed_engine(tiny_chat_model):
    """`--tp 2` starts a local Ray cluster, places a SchedulerActor, a Drafter and two TargetShard
    actors, and prints what the in-process engine gives (float64: exactly the same tokens)."""
    from ddtree.config import GenerateConfig
    from ddtree.engine import Engine

    prompt = "Tell me about trees."
    config = GenerateConfig(model=str(tiny_chat_model), dtype="float64", budget=16, max_tokens=10,
                            sampling=SamplingParams(temperature=0.9, seed=3))
    engine = Engine.from_config(config)
    expected = engine.generate(engine.chat_requests([prompt], config))[0]
    proc = run("--model", str(tiny_chat_model), "--dtype", "float64", "--budget", "16", "--max-tokens", "10",
               "--json", "--prompt", prompt, "--seed", "3", "--temperature", "0.9", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.splitlines()[-1])
    assert line["tokens"] == expected.tokens and line["text"] == expected.text
    assert "transport" in line["round_time_s"]


def test_serve_says_which_port_is_held_instead_of_hanging_in_rays_start_up(tiny_chat_model, monkeypatch, capsys):
    """Started again moments after a server was stopped, `ddtree serve` hung for minutes and then
    failed with Ray's "The current node timed out during startup": the old Ray's processes still
    held the metrics port (8080), and the new metrics agent could not bind it. Now it waits a
    while for the port, and when it stays held says which port and how to choose another, before
    Ray starts."""
    import socket

    import ray

    from ddtree import cli
    from ddtree.serve import launch

    from .helpers import free_port

    monkeypatch.setattr(launch, "PORT_WAIT_S", 1.0)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        code = cli.main(["serve", "--model", str(tiny_chat_model), "--port", str(free_port()),
                         "--metrics-port", str(held)])
    err = capsys.readouterr().err
    assert code == 2 and not ray.is_initialized()
    assert f"port {held} (Ray's metrics) is still in use after 1 s" in err and "--metrics-port" in err
