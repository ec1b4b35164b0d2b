"""Topology parsing and placement planning on recorded `nvidia-smi topo -m` matrices (in the
tool's own tab-separated layout) of three 8-GPU nodes: NVSwitch (NV18 everywhere), PCIe with
two NUMA nodes (PIX / NODE / SYS), and mixed (NVLink-bridged pairs, PCIe between them); and the
plan's placement as the configuration takes it (tests/test_distributed.py checks that the engine
makes that placement group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from ddtree.cluster.placement import GIB, Footprint, plan
from ddtree.config import ModelPairConfig, Placement
from ddtree.cluster.topology import Link, LinkKind, Topology

ROOT = Path(__file__).parent.parent
TOPOLOGY = ROOT / "tests" / "data" / "topology"


def topology(name: str) -> Topology:
    return Topology.parse((TOPOLOGY / f"{name}.txt").read_text())


# Qwen3-8B and Qwen3-32B shapes (config.json fields), bf16.
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
QWEN3_32B = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def test_parses_links_islands_and_numa_nodes():
    nv, pcie, mixed = topology("nvlink-8gpu"), topology("pcie-8gpu-2numa"), topology("mixed-nvlink-pairs-8gpu")
    assert nv.link(0, 7) == Link(LinkKind.NVLINK, 18) and str(nv.link(3, 4)) == "NV18"
    assert nv.islands() == [list(range(8))]
    assert [pcie.link(0, j).kind.name for j in range(1, 8)] == ["PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    assert pcie.islands() == [[g] for g in range(8)]
    assert mixed.islands() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mixed.link(1, 2).kind is LinkKind.PXB and mixed.link(1, 5).kind is LinkKind.SYS
    for t in (nv, pcie, mixed):
        assert t.numa == {g: g // 4 for g in range(8)}
        assert all(t.link(a, b) == t.link(b, a) for a in range(8) for b in range(8) if a != b)


def test_rejects_what_is_not_a_topology_matrix():
    with pytest.raises(ValueError, match="no GPU matrix"):
        Topology.parse("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    bad = (TOPOLOGY / "pcie-8gpu-2numa.txt").read_text().replace("PIX", "XYZ", 1)
    with pytest.raises(ValueError, match="unknown link 'XYZ'"):
        Topology.parse(bad)


def test_footprint_counts_qwen3_8b_parameters():
    """Qwen3-8B has 8.19 B parameters (its model card): 16.4 GB in bf16."""
    assert Footprint.from_hf_config(QWEN3_8B).weight_bytes / 2 == pytest.approx(8.19e9, rel=0.01)


def test_a_model_that_fits_one_gpu_runs_one_replica_per_gpu_everywhere():
    for name in ("nvlink-8gpu", "pcie-8gpu-2numa", "mixed-nvlink-pairs-8gpu"):
        p = plan(Footprint.from_hf_config(QWEN3_8B), 80 * GIB, topology(name))
        assert (p.tp, p.pp, len(p.replicas)) == (1, 1, 8)
        assert p.placement() == Placement(bundles=[{"CPU": 2, "GPU": 1}], strategy="STRICT_PACK")


def test_two_gpu_model_uses_tp_inside_nvlink_and_pipeline_stages_over_pcie():
    """Qwen3-32B (65.5 GB bf16) + KV headroom needs 2 GPUs of 80 GB."""
    big = Footprint.from_hf_config(QWEN3_32B)
    nv = plan(big, 80 * GIB, topology("nvlink-8gpu"))
    assert (nv.tp, nv.pp, nv.need) == (2, 1, 2)
    assert [r.stages for r in nv.replicas] == [((0, 1),), ((2, 3),), ((4, 5),), ((6, 7),)]
    mixed = plan(big, 80 * GIB, topology("mixed-nvlink-pairs-8gpu"))
    assert (mixed.tp, mixed.pp) == (2, 1)
    assert all(mixed.replicas[i].gpus == (2 * i, 2 * i + 1) for i in range(4))  # each on its NVLink pair
    pcie = plan(big, 80 * GIB, topology("pcie-8gpu-2numa"))
    assert (pcie.tp, pcie.pp) == (1, 2), "over PCIe, pipeline stages beat an all-reduce per layer"
    assert [r.stages for r in pcie.replicas] == [((0,), (1,)), ((2,), (3,)), ((4,), (5,)), ((6,), (7,))]
    for r in pcie.replicas:  # both stages behind one PCIe switch, never across sockets
        assert topology("pcie-8gpu-2numa").link(*r.gpus).kind is LinkKind.PIX
    assert len(pcie.placement().bundles) == 2


def test_four_gpu_model_on_the_mixed_node_keeps_tp_on_the_nvlink_pairs_and_stages_inside_a_numa_node():
    big = Footprint(weight_bytes=int(180 * GIB), kv_heads=8)
    t = topology("mixed-nvlink-pairs-8gpu")
    p = plan(big, 80 * GIB, t)
    assert (p.need, p.tp, p.pp) == (4, 2, 2)
    assert [r.stages for r in p.replicas] == [((0, 1), (2, 3)), ((4, 5), (6, 7))]
    assert all(t.worst_link(list(r.gpus)) is LinkKind.PXB for r in p.replicas)
    nv = plan(big, 80 * GIB, topology("nvlink-8gpu"))
    assert (nv.tp, nv.pp, len(nv.replicas)) == (4, 1, 2)


def test_tp_never_exceeds_the_key_value_heads_and_too_big_a_model_is_refused():
    few_heads = Footprint(weight_bytes=int(200 * GIB), kv_heads=2)  # needs 4 GPUs
    p = plan(few_heads, 80 * GIB, topology("nvlink-8gpu"))
    assert p.tp == 2 and p.pp == 2
    with pytest.raises(ValueError, match=r"needs 13 GPUs of 80 GiB .*this node has 8"):
        plan(Footprint(weight_bytes=int(700 * GIB), kv_heads=8), 80 * GIB, topology("nvlink-8gpu"))


def test_the_plans_placement_is_what_a_tp_config_takes():
    """`ddtree plan` prints `placement`; pasted into a config's `placement` it is the engine's
    placement group. A plan the engine cannot run (pipeline stages) or a placement at tp 1 (the
    in-process engine, which Ray places as one replica) is refused, naming what to do."""
    nv = plan(Footprint.from_hf_config(QWEN3_32B), 80 * GIB, topology("nvlink-8gpu"))
    printed = nv.to_dict()["placement"]
    assert printed == {"bundles": [{"CPU": 2, "GPU": 1}] * 2, "strategy": "STRICT_PACK"}
    assert ModelPairConfig(tp=nv.tp, placement=printed).placement == nv.placement()
    staged = plan(Footprint.from_hf_config(QWEN3_32B), 80 * GIB, topology("pcie-8gpu-2numa"))
    with pytest.raises(ValidationError, match=r"2 bundles for tp 1.*pp > 1, cannot be served"):
        ModelPairConfig(tp=staged.tp, placement=staged.to_dict()["placement"])
    with pytest.raises(ValidationError, match="at tp 1 the engine runs in-process"):
        ModelPairConfig(placement={"bundles": [{"CPU": 2, "GPU": 1}]})
    with pytest.raises(ValidationError, match="bundle 1 has 0.5 CPUs"):
        ModelPairConfig(tp=2, placement={"bundles": [{"CPU": 1}, {"CPU": 0.5}]})
    with pytest.raises(ValidationError, match="some bundles have GPUs and some not"):
        ModelPairConfig(tp=2, placement={"bundles": [{"CPU": 1, "GPU": 1}, {"CPU": 1}]})


def test_the_nvlink_rayservice_serves_the_plans_placement():
    """The NVLink sample runs tp 2: its args carry the placement the planner prints for the
    node recorded in its `ddtree.io/plan` annotation."""
    from ddtree.serve.config import ServeConfig

    service = yaml.safe_load((ROOT / "cluster" / "kuberay" / "rayservice-gpu-nvlink.yaml").read_text())
    recorded = dict(kv.split("=") for kv in service["metadata"]["annotations"]["ddtree.io/plan"].split())
    hf = json.loads((ROOT / "tests" / "data" / "models" / "qwen3-8b.json").read_text())
    footprint = Footprint.from_hf_config(hf, 2, GIB, int(recorded["kv-tokens"]))
    chosen = plan(footprint, int(recorded["gpu-memory-gib"]) * GIB, topology(recorded["topology"]))
    args = ServeConfig.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    assert args.tp == chosen.tp == 2
    assert args.placement == chosen.placement()


@pytest.mark.parametrize("name", ["rayservice-gpu-nvlink", "rayservice-gpu-pcie"])
def test_the_gpu_samples_fetch_weights_with_a_command_the_image_has(name):
    """The GPU samples' init containers called `huggingface-cli`, which huggingface_hub 1.x
    removed (the image installs 2.x from constraints.txt): the pods never got their weights.
    Every command an init container chains must be a console script of the installed packages."""
    from importlib.metadata import entry_points

    scripts = {e.name for e in entry_points(group="console_scripts")}
    service = yaml.safe_load((ROOT / "cluster" / "kuberay" / f"{name}.yaml").read_text())
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    inits = [c for g in groups for c in g["template"]["spec"].get("initContainers", [])]
    assert inits, "the sample fetches its weights in an init container"
    for container in inits:
        for step in " ".join(container["args"]).split("&&"):
            command = step.split()[0]
            assert command in scripts, f"{name}: {command!r} is no command of the image's packages"


def test_the_image_installs_at_the_constraints_and_builds_the_cpu_kernels():
    """cluster/Dockerfile installed ddtree at whatever releases were newest, not the ones
    `make install` tests (constraints.txt), and left the CPU kernels to compile on a replica's
    first forward."""
    lines = (ROOT / "cluster" / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    installs = [part for line in lines for part in line.split("&&") if "pip install" in part]
    assert any("/home/ray/ddtree " in f"{p} " for p in installs), "ddtree itself is installed"
    for part in installs:
        if "torch==" not in part:  # torch: its own pin and index, as in the Makefile
            assert "-c /home/ray/ddtree/constraints.txt" in part, part
    assert any("ddtree build-kernels" in line for line in lines)


def test_an_engine_replica_reserves_and_decodes_on_the_machines_cores_by_default():
    """Unset, `engine_num_cpus` is every core of the node: the engine replica's Ray reservation,
    and so its intra-op threads (engine_threads), are what the engine in process uses, not the one
    core it once had on a 2-core machine. Set, it is taken as is; at tp > 1 the replica only
    schedules and reserves 1 (its shards reserve their own bundles). The ingress reserves none."""
    import os

    import ray

    from ddtree.serve.app import build_app, engine_cpus
    from ddtree.serve.config import ServeConfig

    # without Ray (`serve run`'s import), this machine's cores; where the test run's cluster has
    # started in this process, its largest node's CPUs (the session cluster declares more than
    # the machine has)
    cores = len(os.sched_getaffinity(0))
    if ray.is_initialized():
        cores = int(max(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]))
    assert engine_cpus(ServeConfig()) == cores
    assert engine_cpus(ServeConfig(engine_num_cpus=0.5)) == 0.5
    assert engine_cpus(ServeConfig(tp=2)) == 1
    ingress = build_app({})._bound_deployment
    engine = ingress.init_args[1]._bound_deployment
    assert engine.ray_actor_options["num_cpus"] == cores
    assert ingress.ray_actor_options["num_cpus"] == 0
