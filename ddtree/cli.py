"""`ddtree` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from .config import GenerateConfig, ModelPairConfig, SamplingParams
from .flags import add_field_flags, field_values, flag_name

# The flags that set config fields: each takes its type, default and help from the field.
GENERATE_FIELDS = ("model", "drafter", "budget", "lookup", "topk", "max_tokens", "stop", "dtype", "weights", "tp",
                   "deterministic", "cuda_graphs")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")
SERVE_FIELDS = ("model", "drafter", "budget", "lookup", "topk", "deterministic", "cuda_graphs")  # on top of --config's
BENCH_FIELDS = ("model", "drafter", "dtype", "weights")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _generate(args: argparse.Namespace) -> int:
    try:
        config = GenerateConfig(
            **field_values(args, GENERATE_FIELDS), sampling=SamplingParams(**field_values(args, SAMPLING_FIELDS))
        )
    except ValidationError as err:
        for e in err.errors():
            where = f"{flag_name(str(e['loc'][-1]))}: " if e["loc"] else ""  # a rule over several fields has none
            print(f"ddtree generate: {where}{e['msg']}", file=sys.stderr)
        return 2
    from .engine import Engine, KernelsUnavailable  # heavy imports after the arguments are known to be valid

    try:
        engine = Engine.from_config(config)
    except KernelsUnavailable as err:
        print(f"ddtree generate: {err}", file=sys.stderr)
        return 2
    for prompt, result in zip(args.prompt, engine.generate(engine.chat_requests(args.prompt, config))):
        seconds = result.prefill_s + result.decode_s
        record = {
            "prompt": prompt,
            "text": result.text,
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "seed": result.seed,
            "budget": engine.budget,
            "rounds": len(result.rounds),
            "tau": round(result.tau, 3),
            "tokens_per_s": round(len(result.tokens) / seconds, 2) if seconds else None,
            "prefill_s": round(result.prefill_s, 4),
            "decode_s": round(result.decode_s, 4),
            "round_time_s": {phase: round(s, 4) for phase, s in result.phase_s().items()},
        }
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(result.text, flush=True)
            print(
                f"[{len(result.tokens)} tokens, {record['rounds']} rounds, tau {record['tau']}, "
                f"{record['tokens_per_s']} tokens/s, budget {engine.budget}]",
                file=sys.stderr,
            )
    return 0


def _serve_fields(path: str) -> dict:
    """The ServeConfig fields of a YAML: the file itself, or a Serve config file's first
    application's `args`."""
    import yaml

    with open(path) as f:
        loaded = yaml.safe_load(f) or {}
    return loaded["applications"][0].get("args", {}) if "applications" in loaded else loaded


def _serve_config(args: argparse.Namespace):
    """ServeConfig from --config (ServeConfig fields, or a Serve config file whose first
    application's `args` are) with the command-line flags on top."""
    import yaml

    from .serve.config import ServeConfig

    fields = _serve_fields(args.config) if args.config else {}
    fields.update(field_values(args, SERVE_FIELDS))
    keys = list(getattr(args, "api_key", None) or [])
    keys += [k.strip() for k in os.environ.get("DDTREE_API_KEY", "").split(",") if k.strip()]
    if keys:
        configured = fields.get("api_key") or []
        fields["api_key"] = ([configured] if isinstance(configured, str) else list(configured)) + keys
    return ServeConfig.model_validate(fields)


def _serve(args: argparse.Namespace) -> int:
    try:
        config = _serve_config(args)
    except ValidationError as err:
        for e in err.errors():
            print(f"ddtree serve: {'.'.join(map(str, e['loc']))}: {e['msg']}", file=sys.stderr)
        return 2
    if config.deterministic:  # the replica refuses too; here it is said before Ray starts
        from .engine import KernelsUnavailable, check_kernels

        try:
            check_kernels(config)
        except KernelsUnavailable as err:
            print(f"ddtree serve: {err}", file=sys.stderr)
            return 2
    from .serve import launch

    return launch.run(config, args.host, args.port, args.metrics_host, args.metrics_port)


def _bench(args: argparse.Namespace) -> int:
    from .config import parse_budget

    try:
        budgets = [parse_budget(b.strip()) for b in args.budgets.split(",")]
        # the policy's step cost is measured at start-up only for an engine whose budget is auto
        config = ModelPairConfig(**field_values(args, BENCH_FIELDS), budget="auto" if "auto" in budgets else 0)
    except (ValueError, ValidationError) as err:
        print(f"ddtree bench: {err}", file=sys.stderr)
        return 2
    if args.concurrency:
        if args.lookup:
            print("ddtree bench: --lookup is for the single-stream comparison, not --concurrency", file=sys.stderr)
            return 2
        return _load_bench(args, config, budgets)
    if 0 not in budgets:
        budgets.insert(0, 0)
    if "chain" not in budgets:
        budgets.insert(1, "chain")
    from tqdm import tqdm

    from .bench import json_rows, markdown, plot, read_prompts, run_bench
    from .engine import Engine

    prompts = read_prompts(args.prompts, args.limit)
    engine = Engine.from_config(config)
    with tqdm(total=len(prompts), desc="prompts", unit="prompt") as bar:
        rows = run_bench(engine, prompts, budgets, args.max_tokens, peers=not args.no_peers,
                         progress=lambda done, total: bar.update(1), lookup=args.lookup)
    print(f"{len(prompts)} prompts from {args.prompts}, {args.max_tokens} new tokens, greedy, {config.dtype}, "
          f"weights {config.weights}, {torch_threads()} threads")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_rows(rows), f, indent=2)
    if args.plot:
        plot(rows, args.plot, f"{Path(args.prompts).name}: {len(prompts)} prompts, {args.max_tokens} tokens")
    return 0


def _audit(args: argparse.Namespace) -> int:
    """`ddtree audit`: every output of a grid of settings against plain decoding alone; exit 1 on
    a real divergence (ddtree.audit says how a near-tie is told from one)."""
    from tqdm import tqdm

    from . import audit
    from .bench import read_prompts
    from .config import parse_budget
    from .engine import Engine

    try:
        budgets = [parse_budget(b.strip()) for b in args.budgets.split(",")]
        topks = [None if k.strip() == "none" else int(k) for k in args.topk.split(",")]
        lookups = [{"on": True, "off": False}[v.strip()] for v in args.lookup.split(",")]
        seeded = [{"greedy": False, "seeded": True}[v.strip()] for v in args.sampling.split(",")]
        streams = [int(n) for n in args.streams.split(",")]
        if any(k is not None and k < 1 for k in topks) or any(n < 1 for n in streams):
            raise ValueError("topk and streams must be at least 1")
        if args.url and args.dump:
            raise ValueError("--dump records the rounds of the engine in process, not a server's (--url)")
        if args.url:  # the engine here only decodes plainly, one request at a time
            config = ModelPairConfig(**field_values(args, BENCH_FIELDS), budget=0, max_num_seqs=1, lookup=False)
        else:  # a step holds the largest batch, each tree up to budget 64's 65 rows (what start-up measures)
            config = ModelPairConfig(**field_values(args, BENCH_FIELDS), budget="auto" if "auto" in budgets else 0,
                                     max_num_seqs=max(streams), max_step_tokens=65 * max(streams), lookup=False)
    except (ValueError, KeyError, ValidationError) as err:
        print(f"ddtree audit: {err}", file=sys.stderr)
        return 2
    settings = audit.grid(budgets, topks, lookups, seeded, streams)
    engine = Engine.from_config(config)
    texts = read_prompts(args.prompts, args.limit)
    prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in texts]
    served = audit.ServedOutputs(args.url, texts, prompts, args.max_tokens, args.served_model,
                                 args.api_key) if args.url else None
    greedy_reference = None
    if args.reference == "transformers":
        greedy_reference = audit.TransformersReference(engine.target.directory, engine.target.model.dtype,
                                                       engine.eos_token_ids)
    runs = len(prompts) * (len(set(seeded)) + len(settings))
    with tqdm(total=runs, desc="completions", unit="run") as bar:
        try:
            report = audit.run_audit(engine, prompts, settings, args.max_tokens, progress=lambda: bar.update(1),
                                     dump_dir=args.dump, served=served, greedy_reference=greedy_reference,
                                     checkpoint=args.checkpoint)
        except ValueError as err:  # the server renders the prompts otherwise
            print(f"ddtree audit: {err}", file=sys.stderr)
            return 2
    against = "; ".join(f"{kind} against {name}" for kind, name in report.references.items())
    print(f"{len(prompts)} prompts from {args.prompts}, {args.max_tokens} new tokens, {report.dtype}: "
          f"{report.compared} completions of {report.audited} ({against})")
    print(audit.markdown(report))
    if args.json:
        audit.write_json(report, args.json)
    real = len(report.real)
    print(f"{real} real divergence{'s' if real != 1 else ''}, {len(report.differences) - real} near-ties")
    return 1 if real else 0


def _load_bench(args: argparse.Namespace, config, budgets: list) -> int:
    """`bench --concurrency`: every budget at every number of concurrent streams, one table."""
    from tqdm import tqdm

    from . import load_bench
    from .bench import read_prompts

    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        print("ddtree bench: --concurrency takes comma-separated integers, e.g. 1,4,16,64", file=sys.stderr)
        return 2
    if args.beside_engine and not args.url:
        print("ddtree bench: --beside-engine runs the engine in process beside a server: give its --url", file=sys.stderr)
        return 2
    if args.server_config and not args.beside_engine:
        print("ddtree bench: --server-config describes the engine --beside-engine builds", file=sys.stderr)
        return 2
    texts = read_prompts(args.prompts, args.limit)
    cells = [(b, c) for b in budgets for c in levels]
    rows, beside = [], []
    if args.url:
        model = args.served_model or load_bench.served_model(args.url, args.api_key)
        engine, prompts = None, None
        if args.beside_engine:
            from .engine import Engine
            from .serve.config import ServeConfig

            try:
                fields = _serve_fields(args.server_config) if args.server_config else {}
                served = ServeConfig.model_validate({**fields, **field_values(args, BENCH_FIELDS)})
            except (OSError, ValueError, KeyError, ValidationError) as err:
                print(f"ddtree bench: --server-config: {err}", file=sys.stderr)
                return 2
            # the server's engine, in this process: the same model pair, batch limits and budget
            engine = Engine.from_config(ModelPairConfig.model_validate(
                served.model_dump(include=set(ModelPairConfig.model_fields))))
            prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in texts]
            load_bench.run_inprocess(engine, prompts, 0, 1, 1, 4)  # warm-up
        load_bench.run_url(args.url, model, texts, 0, 1, 1, 4, args.api_key)  # warm-up
        for budget, c in tqdm(cells, desc="cells", unit="cell"):
            requests = args.requests or max(c, len(texts))
            rows.append(load_bench.run_url(args.url, model, texts, budget, c, requests, args.max_tokens, args.api_key))
            if engine is not None:  # right after, so that drift on the machine hits both alike
                beside.append(load_bench.ServedBeside(
                    rows[-1], load_bench.run_inprocess(engine, prompts, budget, c, requests, args.max_tokens)))
        where = args.url + (f", beside the same engine in process ({torch_threads()} threads)" if beside else "")
    else:
        from .engine import Engine

        engine = Engine.from_config(config.model_copy(update={"max_num_seqs": max(levels), "max_step_tokens": max(
            config.max_step_tokens, max(levels))}))
        prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in texts]
        load_bench.run_inprocess(engine, prompts, 0, 1, 1, 4)  # warm-up
        for budget, c in tqdm(cells, desc="cells", unit="cell"):
            rows.append(load_bench.run_inprocess(engine, prompts, budget, c, args.requests or max(c, len(texts)),
                                                 args.max_tokens))
        where = "in process"
    print(f"{len(texts)} prompts from {args.prompts}, {args.max_tokens} new tokens, greedy, {where}")
    print(load_bench.markdown_beside(beside) if beside else load_bench.markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([c.summary() for c in beside] if beside else [r.summary() for r in rows], f, indent=2)
    if args.plot:
        load_bench.plot(rows, args.plot, f"{Path(args.prompts).name}: {args.max_tokens} tokens, {where}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    """`ddtree trace`: record a trace (ddtree.trace) of prompts from one or more files."""
    from tqdm import tqdm

    from . import trace
    from .bench import MIXED_FILES, interleaved_prompts
    from .config import parse_budget

    try:
        config = ModelPairConfig(**field_values(args, BENCH_FIELDS), budget=parse_budget(args.budget),
                                 max_num_seqs=args.streams, max_step_tokens=max(1024, args.streams))
    except (ValueError, ValidationError) as err:
        print(f"ddtree trace: {err}", file=sys.stderr)
        return 2
    files = args.prompts or [str(Path("benchmarks/data") / f) for f in MIXED_FILES]
    texts = interleaved_prompts(files, args.per_file)
    from .engine import Engine

    engine = Engine.from_config(config)
    # the completions first, kept beside the output: an interrupted recording starts again from them
    done = Path(str(args.out) + ".completions.json")
    completions = json.loads(done.read_text()) if done.is_file() else None
    if completions is None:
        print(f"ddtree trace: {len(texts)} completions, {args.max_tokens} tokens, budget {config.budget}, "
              f"{args.streams} at a time", file=sys.stderr, flush=True)
    with tqdm(total=len(texts), desc="candidates", unit="sequence") as bar:
        recorded = trace.record(engine, texts, args.max_tokens, args.topk, budget=config.budget,
                                completions=completions, progress=lambda i, n: bar.update(1),
                                on_completions=lambda c: done.write_text(json.dumps(c)))
    recorded.meta.update(prompt_files=[Path(f).name for f in files], per_file=args.per_file,
                         model=config.model or "SmolLM2-135M-Instruct", drafter=config.drafter or "shipped",
                         dtype=config.dtype, weights=config.weights)
    recorded.save(args.out)
    done.unlink(missing_ok=True)
    size = Path(args.out).stat().st_size
    print(f"{args.out}: {len(recorded.sequences)} sequences, "
          f"{sum(len(s.completion) for s in recorded.sequences)} completion tokens, K {args.topk}, {size / 1e6:.2f} MB")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """`ddtree simulate`: replay a trace under cost models and policies (ddtree.simulate)."""
    from . import simulate
    from .config import parse_budget

    try:
        policies = [parse_budget(p.strip()) for p in args.policy.split(",")]
        levels = [int(c) for c in args.concurrency.split(",")]
        costs = [simulate.CostModel.load(c) for c in args.cost]
    except (ValueError, OSError) as err:
        print(f"ddtree simulate: {err}", file=sys.stderr)
        return 2
    recorded = simulate.Trace.load(args.trace)
    rows = []
    for cost in costs:
        for c in levels:
            for policy in policies:
                rows.append(simulate.simulate(recorded, cost, policy, c, requests=args.requests,
                                              lookup=args.lookup, max_step_tokens=args.max_step_tokens))
                if args.progress:
                    print(rows[-1].line(), file=sys.stderr, flush=True)
    print(f"{args.trace}: {len(recorded.sequences)} sequences; virtual seconds under each cost model")
    print(simulate.markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.summary() for r in rows], f, indent=2)
    return 0


def parse_mix(text: str) -> dict[str, float]:
    """'code=0.4,chat=0.4,math=0.2' -> {'code': 0.4, ...}; the domains data.OPENERS knows."""
    from .training.data import OPENERS

    mix = {}
    for part in text.split(","):
        domain, _, share = part.partition("=")
        domain = domain.strip()
        if domain not in OPENERS:
            raise argparse.ArgumentTypeError(f"unknown domain {domain!r}; known: {', '.join(OPENERS)}")
        try:
            mix[domain] = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: give domain=share, e.g. code=0.4") from None
    if sum(mix.values()) <= 0 or min(mix.values()) < 0:
        raise argparse.ArgumentTypeError("shares must be >= 0 and not all 0")
    return mix


def _train_drafter(args: argparse.Namespace) -> int:
    import time

    import torch

    from .training import TrainConfig, stage_data, stage_export, stage_features, stage_train
    from .training.data import DEFAULT_HELD_OUT, export_tokens
    from .training.train import FIT_PROBE_STEPS
    from .workers.drafter import default_target_layer_ids
    from .workers.loading import load_target

    workdir = Path(args.workdir)
    if args.stage == "tokens":
        path = Path(args.out or workdir / "tokens.safetensors")
        counts = export_tokens(workdir, path)
        print(f"{counts['sequences']} sequences, {counts['tokens']} tokens written to {path}")
        return 0
    target = load_target(args.model, torch.float32)
    target.model.to(args.device)
    layers = tuple(args.target_layers) if args.target_layers else default_target_layer_ids(target.model.config.num_hidden_layers)
    cfg = TrainConfig(block_size=args.block_size, num_layers=args.layers,
                      mask_token_id=args.mask_token_id, steps=args.steps, seed=args.seed,
                      vocab_floor=None if args.vocab_floor < 0 else args.vocab_floor, distill=args.distill,
                      sequences_per_step=args.sequences_per_step, anchors_per_sequence=args.anchors,
                      **({"lr": args.lr} if args.lr else {}))
    stages = ["data", "train", "export"] if args.stage == "all" else [args.stage]
    if "data" in stages and args.from_tokens:
        written = stage_features(target, workdir, Path(args.from_tokens), layers)
        print(f"data: features recomputed for {written} sequences of {args.from_tokens}")
    elif "data" in stages:
        left = stage_data(target, workdir, args.prompts or [], args.limit_per_file, args.self_prompts, layers,
                          args.max_tokens, args.batch, args.seed, mix=args.mix,
                          held_out=args.held_out if args.held_out is not None else DEFAULT_HELD_OUT,
                          skip_per_file=args.skip_per_file,
                          deadline=time.time() + 60 * args.data_minutes if args.data_minutes else None)
        if left:
            print(f"data: {left} shards left (time limit); run the data stage again to make them")
    if "train" in stages:
        deadline = time.time() + 60 * args.minutes if args.minutes else None
        state = stage_train(target, workdir, cfg, layers, deadline,
                            init_from=Path(args.init_from) if args.init_from else None,
                            fit_after=FIT_PROBE_STEPS if args.fit_schedule else None)
        if state.step < cfg.steps:
            print(f"stopped at step {state.step} of {cfg.steps} (time limit); run the train stage again to go on")
            return 0
    if "export" in stages:
        files = ", ".join(Path(p).name for p in args.prompts or [])
        out = stage_export(target, workdir, cfg, layers, Path(args.out or workdir / "export"),
                           data_note=f"prompts from {files or 'no files'} and {args.self_prompts} target-written prompts",
                           layout=args.export_layout, vocab_keep=args.vocab_keep)
        print(f"drafter written to {out}")
    return 0


def _eval_drafter(args: argparse.Namespace) -> int:
    import torch

    from .bench import read_prompts
    from .config import parse_budget
    from .training import eval_drafter
    from .workers.drafter import DFlashDrafter
    from .workers.loading import load_target

    target = load_target(args.model, torch.float32)
    target.model.to(args.device)
    directory = Path(args.drafter) if args.drafter else default_drafter_path()
    drafter = DFlashDrafter.load(directory, target.model).to(args.device)
    budgets = [parse_budget(b.strip()) for b in args.budgets.split(",")]
    if args.record and len(args.prompts) > 1:
        print("ddtree eval-drafter: --record stores one file's report; give one --prompts", file=sys.stderr)
        return 2
    reports = {}
    for path in args.prompts:  # one report per file: tau per domain
        report = eval_drafter(target, drafter, read_prompts(path, args.limit), args.max_tokens, budgets,
                              engine=args.engine, lookup=args.lookup)
        reports[Path(path).stem] = report | {"file": Path(path).name, "max_tokens": args.max_tokens}
    columns = list(next(iter(reports.values()))["tau"])
    print(f"tau, greedy, {args.max_tokens} tokens, first {args.limit} prompts of each file")
    print("| prompts | " + " | ".join(columns) + " | top-1 accuracy, positions 1-3 |")
    print("| --- |" + " --- |" * (len(columns) + 1))
    for name, report in reports.items():
        print(f"| {name} ({report['prompts']}) | " + " | ".join(f"{report['tau'][c]:.2f}" for c in columns)
              + " | " + ", ".join(f"{a:.2f}" for a in report["accuracy"][:3]) + " |")
    out = next(iter(reports.values())) if len(reports) == 1 else reports
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.record:
        record = directory / "eval.json"
        records = json.loads(record.read_text()) if record.is_file() else {}
        records[args.record] = out
        record.write_text(json.dumps(records, indent=2) + "\n")
    return 0


def default_drafter_path():
    from .engine import shipped_drafter

    path = shipped_drafter()
    if path is None:
        raise SystemExit("no drafter given and none ships with this package: pass --drafter DIR")
    return path


def _plan(args: argparse.Namespace) -> int:
    from .cluster.placement import GIB, Footprint, plan
    from .cluster.topology import Topology, read_topology

    config_path = Path(args.model_config)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    try:
        hf = json.loads(config_path.read_text())
        if args.topology:
            topology = Topology.parse(Path(args.topology).read_text())
        else:
            topology = read_topology()
            if topology is None:
                print("ddtree plan: no NVIDIA GPU here; pass --topology FILE (the output of `nvidia-smi topo -m`)", file=sys.stderr)
                return 2
        dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
        footprint = Footprint.from_hf_config(hf, dtype_bytes, int(args.drafter_gib * GIB), args.kv_tokens)
        chosen = plan(footprint, int(args.gpu_memory_gib * GIB), topology, max_replicas=args.max_replicas)
    except (OSError, ValueError, KeyError) as err:
        print(f"ddtree plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(chosen.to_dict(), indent=2))
    return 0


def _dashboards(args: argparse.Namespace) -> int:
    from .dashboards.ddtree_dashboard import dashboard_json

    if args.action == "export":
        text = json.dumps(dashboard_json(), indent=2)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        else:
            print(text)
        return 0
    from .dashboards.grafana import GrafanaAuth, push

    try:
        auth = GrafanaAuth.from_env(args.grafana_url, args.token, args.user, args.password)
    except ValueError as err:
        print(f"ddtree dashboards push: {err}", file=sys.stderr)
        return 2
    answer = push(auth, args.prometheus_url, args.folder_uid)
    print(f"dashboard {answer.get('uid')} at {auth.url.rstrip('/')}{answer.get('url', '')}")
    return 0


def _build_kernels(args: argparse.Namespace) -> int:
    """Compiles ddtree's CPU kernels into the cache (once per machine, source and torch), loads
    this CPU's build, and says where each build is and for which instruction set. --all also
    compiles the builds for the other vector widths (an image that runs on other CPUs)."""
    from .workers import cpu_kernels

    own = cpu_kernels.vector_build()
    try:
        for vector in sorted(set(cpu_kernels.VECTOR_FLAGS) | {own} if args.all else {own}):
            library = cpu_kernels.build_kernels(vector=vector)
            print(f"ddtree: CPU kernels built for {vector} in {library}")
        cpu_kernels.load_kernels()
    except cpu_kernels.KernelsNotBuilt as err:
        print(f"ddtree build-kernels: {err}", file=sys.stderr)
        return 1
    print(f"ddtree: this CPU runs the {own} build")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags (the flags of config fields come from the models)."""
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for chat prompts (in-process, or on Ray with --tp N)")
    gen.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    add_field_flags(gen.add_argument_group("GenerateConfig fields"), GenerateConfig, GENERATE_FIELDS)
    add_field_flags(gen.add_argument_group("SamplingParams fields"), SamplingParams, SAMPLING_FIELDS)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="start the OpenAI-compatible server on a local Ray")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--config", help="YAML: ServeConfig fields, or a Serve config file (cluster/serve-config.yaml)")
    from .serve.config import ServeConfig

    add_field_flags(srv.add_argument_group("ServeConfig fields", "each overrides the --config file's"),
                    ServeConfig, SERVE_FIELDS)
    srv.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus endpoint")
    srv.add_argument("--metrics-host", help="where the metrics endpoint listens: a loopback address keeps it "
                     "on this machine, anything else exposes it on every interface (default: --host)")
    srv.add_argument("--api-key", action="append",
                     help="require `Authorization: Bearer KEY` on every route but /health (repeatable; "
                     "DDTREE_API_KEY, comma-separated, adds keys)")
    srv.set_defaults(func=_serve)

    kernels = sub.add_parser("build-kernels", help="compile ddtree's C++ CPU kernels into the cache (make install "
                             "does), so that no server compiles them")
    kernels.add_argument("--all", action="store_true", help="also build for the other vector widths ("
                         "AVX2, AVX512): for an image whose nodes' CPUs may differ from this one")
    kernels.set_defaults(func=_build_kernels)

    bench = sub.add_parser("bench", help="ddtree at every budget against transformers, side by side")
    bench.add_argument("--prompts", required=True, help="JSONL with question, turns[0] or prompt")
    bench.add_argument("--limit", type=int, default=20)
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--budgets", default="0,8,16,32,64", help="comma-separated; 0 and chain are always run")
    add_field_flags(bench.add_argument_group("ModelPairConfig fields"), ModelPairConfig, BENCH_FIELDS)
    bench.add_argument("--json", help="write one row per setting here")
    bench.add_argument("--plot", help="write a PNG of tau and speed-up against the budget here")
    bench.add_argument("--no-peers", action="store_true", help="skip transformers generate / prompt lookup")
    bench.add_argument("--lookup", action="store_true",
                       help="every tree budget (not 0, not the chain) also runs with lookup branches in its trees")
    bench.add_argument("--concurrency", help="comma-separated stream counts, e.g. 1,4,16,64: aggregate tokens/s, "
                       "TTFT and inter-token latency per budget and concurrency (closed-loop streams)")
    bench.add_argument("--requests", type=int, help="with --concurrency: completions per cell "
                       "(default: max(streams, prompts))")
    bench.add_argument("--url", help="with --concurrency: a running server (e.g. http://127.0.0.1:8000) "
                       "instead of the in-process engine")
    bench.add_argument("--served-model", help="with --url: the model name to ask for (default: what the server's "
                       "/v1/models lists first)")
    bench.add_argument("--beside-engine", action="store_true",
                       help="with --url: each cell also runs by the same engine in this process, right after the "
                       "server; the table gives served over in-process tokens/s")
    bench.add_argument("--server-config", help="with --beside-engine: the config the server runs (`ddtree serve "
                       "--config FILE`), for the engine in process to be the same (default: `ddtree serve`'s defaults "
                       "with this command's --model, --drafter, --dtype, --weights)")
    bench.add_argument("--api-key", help="with --url: the server's API key")
    bench.set_defaults(func=_bench)

    tr = sub.add_parser("trace", help="record a trace for `ddtree simulate`: completions and the drafter's "
                        "candidates at every position (default prompts: the mixed workload of benchmarks/data)")
    tr.add_argument("--prompts", action="append", help="JSONL with question, turns[0] or prompt (repeatable; "
                    "interleaved; default: gsm8k-test, humaneval, vicuna-bench in benchmarks/data)")
    tr.add_argument("--per-file", type=int, default=12, help="prompts taken from each file")
    tr.add_argument("--max-tokens", type=int, default=128)
    tr.add_argument("--topk", type=int, default=32, help="the drafter's candidates kept per depth")
    tr.add_argument("--budget", default="auto", help="the budget the completions run at (any commits the same "
                    "tokens; auto also measures the drafter's and the step's costs for the trace's metadata)")
    tr.add_argument("--streams", type=int, default=16, help="completions run at once")
    tr.add_argument("--out", required=True, help="the trace file (.npz)")
    add_field_flags(tr.add_argument_group("ModelPairConfig fields"), ModelPairConfig, BENCH_FIELDS)
    tr.set_defaults(func=_trace)

    sim = sub.add_parser("simulate", help="replay a trace under cost models and budget policies: tokens/s per "
                         "concurrency on a virtual clock, deterministic")
    sim.add_argument("--trace", required=True, help="a trace file (`ddtree trace`; benchmarks/traces/)")
    sim.add_argument("--cost", action="append", required=True,
                     help="a cost model JSON (repeatable; benchmarks/costs/: step_seconds as the calibration "
                     "cache holds it, draft_seconds, overhead)")
    sim.add_argument("--policy", default="auto,0,chain,16,64", help="comma-separated budgets")
    sim.add_argument("--concurrency", default="1,4,16,64", help="comma-separated stream counts")
    sim.add_argument("--requests", type=int, help="completions per cell (default: max(2 x streams, sequences))")
    sim.add_argument("--max-step-tokens", type=int, default=1024, help="verify rows per step (BatchLimits)")
    sim.add_argument("--lookup", action="store_true", help="lookup branches in every tree budget's trees")
    sim.add_argument("--json", help="write one row per cell here")
    sim.add_argument("--progress", action="store_true", help="each cell's line on stderr as it ends")
    sim.set_defaults(func=_simulate)

    aud = sub.add_parser("audit", help="every output of a grid of settings against the target's plain decoding; "
                         "exit 1 on a real divergence (near-ties listed with their gaps)")
    aud.add_argument("--prompts", required=True, help="JSONL with question, turns[0] or prompt")
    aud.add_argument("--limit", type=int, default=20)
    aud.add_argument("--max-tokens", type=int, default=64)
    aud.add_argument("--budgets", default="0,chain,16,64,auto", help="comma-separated budgets")
    aud.add_argument("--topk", default="none", help="comma-separated topk values ('none': as many as the budget)")
    aud.add_argument("--lookup", default="off", help="comma-separated: on, off")
    aud.add_argument("--sampling", default="greedy,seeded", help="comma-separated: greedy, seeded (T 0.8, a seed per prompt)")
    aud.add_argument("--streams", default="1,8", help="comma-separated: requests batched together")
    add_field_flags(aud.add_argument_group("ModelPairConfig fields"), ModelPairConfig, BENCH_FIELDS)
    aud.add_argument("--json", help="write the summary and every difference here")
    aud.add_argument("--dump", help="a folder: each difference's round (tree, padding, mask, positions, accepted "
                     "path) as JSON, from the diverging batch run again (in process only)")
    aud.add_argument("--checkpoint", help="a file: every completion is kept there as it is compared, and an audit "
                     "started again with the same file and grid runs only what it does not hold yet")
    aud.add_argument("--url", help="audit a running server (e.g. http://127.0.0.1:8000) through the openai client "
                     "instead of the engine in process; the reference still decodes here, so give the server's "
                     "--model (and --drafter, --dtype, --weights)")
    aud.add_argument("--served-model", help="with --url: the model name to ask for (default: what /v1/models lists first)")
    aud.add_argument("--api-key", help="with --url: the server's API key")
    aud.add_argument("--reference", choices=["ddtree", "transformers"], default="ddtree",
                     help="what greedy outputs are compared with: the target's plain decoding by ddtree, or by Hugging "
                     "Face transformers' generate (an independent implementation); seeded outputs are always compared "
                     "with ddtree's plain decoding, as transformers cannot reproduce its seeded draws")
    aud.set_defaults(func=_audit)

    train = sub.add_parser("train-drafter", help="self-distil a DFlash drafter (resumable stages)")
    train.add_argument("--workdir", required=True, help="data, checkpoints and export live here")
    train.add_argument("--stage", default="all", choices=["data", "train", "export", "all", "tokens"],
                       help="tokens: the data's token ids alone into --out (default WORKDIR/tokens.safetensors), a few "
                       "bytes a token: what --from-tokens makes the data of again, anywhere")
    train.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    train.add_argument("--prompts", action="append", help="training prompts JSONL (repeatable; never evaluation files)")
    train.add_argument("--limit-per-file", type=int, default=400)
    train.add_argument("--skip-per-file", type=int, default=0,
                       help="start each prompts file after this many prompts (those an earlier training run used)")
    train.add_argument("--self-prompts", type=int, default=300, help="prompts the target writes itself")
    train.add_argument("--mix", type=parse_mix, help="shares of the self-written prompts by domain, e.g. "
                       "code=0.4,chat=0.4,math=0.2 (the default; domains: code, chat, math)")
    train.add_argument("--held-out", action="append", help="a JSONL whose prompts never enter training "
                       "(repeatable; default: the judged sets in benchmarks/data)")
    train.add_argument("--max-tokens", type=int, default=160, help="response length")
    train.add_argument("--batch", type=int, default=32, help="sequences generated per forward (and per shard)")
    train.add_argument("--block-size", type=int, default=8)
    train.add_argument("--layers", type=int, default=2,
                       help="the drafter's layers; with --init-from, more than the saved drafter's adds layers on top")
    train.add_argument("--target-layers", type=int, nargs="+", help="default: 1, middle, last-but-three")
    train.add_argument("--mask-token-id", type=int, help="default: the last vocabulary id")
    train.add_argument("--steps", type=int, default=3000)
    train.add_argument("--lr", type=float, help="peak learning rate (default 6e-4)")
    train.add_argument("--distill", type=float, default=0.0, metavar="SHARE",
                       help="the loss's share taken by the target's own distribution at each position (soft labels, "
                       "computed once into data/teacher-*.safetensors) instead of its greedy token; 0: hard labels only")
    train.add_argument("--init-from", metavar="DRAFTER_DIR",
                       help="continue training this saved drafter (e.g. the shipped one) on this run's data")
    train.add_argument("--vocab-floor", type=int, default=8192,
                       help="the draft vocabulary: tokens in the data + ids below this (-1: the whole vocabulary)")
    train.add_argument("--minutes", type=float, help="stop training after this long (checkpointed; rerun to resume)")
    train.add_argument("--fit-schedule", action="store_true",
                       help="with --minutes: once its first steps are timed, shorten --steps to what the clock leaves room "
                       "for at their pace, so the cosine schedule ends as the clock does")
    train.add_argument("--data-minutes", type=float,
                       help="stop the data stage after this long (finished shards stay; rerun to make the rest)")
    train.add_argument("--from-tokens", metavar="FILE",
                       help="data stage: no decoding; the features of a tokens file's sequences (benchmarks/gpu_train.py "
                       "writes one), recomputed with one prefill each")
    train.add_argument("--sequences-per-step", type=int, default=4, help="sequences in a training step's batch")
    train.add_argument("--anchors", type=int, default=24, help="blocks (anchors) per sequence in a training step")
    train.add_argument("--device", default="cpu",
                       help="where the target and the drafter run (data, training, export): cpu, cuda, cuda:1 ...")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--vocab-keep", type=int, metavar="N",
                       help="export: cut the draft vocabulary to the N ids the data's responses use most "
                       "(a cheaper head; default: keep the one it was trained with)")
    train.add_argument("--out", help="export directory (default: WORKDIR/export); with --stage tokens, the file")
    train.add_argument("--export-layout", default="ddtree", choices=["ddtree", "published"],
                       help="ddtree's layout (keeps a draft vocabulary), or exactly z-lab's published one "
                       "(auto_map, no extra tensors; needs --vocab-floor -1)")
    train.set_defaults(func=_train_drafter)

    ev = sub.add_parser("eval-drafter", help="held-out tau per budget and per-position accuracy")
    ev.add_argument("--prompts", required=True, action="append",
                    help="held-out prompts JSONL (repeatable: one row of the table per file, i.e. per domain)")
    ev.add_argument("--drafter", help="default: the drafter shipped with the package")
    ev.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    ev.add_argument("--limit", type=int, default=20)
    ev.add_argument("--max-tokens", type=int, default=128)
    ev.add_argument("--budgets", default="chain,8,16,32,64")
    ev.add_argument("--json", help="write the report here")
    ev.add_argument("--record", metavar="KEY",
                    help="also store the report under KEY in the drafter's eval.json (its tests re-check it)")
    ev.add_argument("--engine", action="store_true",
                    help="run every budget through the engine instead of walking the drafts (slow; same tau)")
    ev.add_argument("--lookup", action="store_true",
                    help="also tau at every tree budget with lookup branches in the trees (keys N+lookup)")
    ev.add_argument("--device", default="cpu", help="where the target and the drafter run: cpu, cuda ...")
    ev.set_defaults(func=_eval_drafter)

    pl = sub.add_parser("plan", help="placement for a target on a GPU node: TP x PP, replicas, GPUs, Ray bundles")
    pl.add_argument("--model-config", required=True, help="the target's config.json (or its checkpoint directory)")
    pl.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU, GiB")
    pl.add_argument("--topology", help="a saved `nvidia-smi topo -m` output (default: run it here)")
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    pl.add_argument("--drafter-gib", type=float, default=1.0, help="the drafter's memory on the first GPU")
    pl.add_argument("--kv-tokens", type=int, default=0,
                    help="tokens of KV cache one replica must hold (concurrent requests x context)")
    pl.add_argument("--max-replicas", type=int, help="cap the replicas (default: as many as fit)")
    pl.set_defaults(func=_plan)

    dash = sub.add_parser("dashboards", help="export or push the Grafana dashboard")
    dash.add_argument("action", choices=["export", "push"])
    dash.add_argument("--out", help="export: write the JSON here (default: stdout)")
    dash.add_argument("--grafana-url", help="push: Grafana's URL (or GRAFANA_URL)")
    dash.add_argument("--token", help="push: service-account token (or GRAFANA_TOKEN)")
    dash.add_argument("--user", help="push: basic-auth user (or GRAFANA_USER)")
    dash.add_argument("--password", help="push: basic-auth password (or GRAFANA_PASSWORD)")
    dash.add_argument("--prometheus-url", default="http://127.0.0.1:9090",
                      help="push: the Prometheus that scrapes Ray, as Grafana reaches it")
    dash.add_argument("--folder-uid", help="push: Grafana folder for the dashboard")
    dash.set_defaults(func=_dashboards)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
