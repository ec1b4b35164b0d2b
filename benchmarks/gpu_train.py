"""A drafter's training run on a GPU, in one command that fits one device call (issue #18).

On a 2-core CPU a training run makes ~0.75M tokens of data in an hour (plain decoding,
64 sequences a forward) and trains ~1 step a second of 4 sequences x 24 anchors: data and
training steps are what limit the drafter. On a GPU both are cheap, and a lent one comes for
minutes. This runs a whole training run against a wall clock:

1. data (`--data-minutes`): prompts from `--prompts` files (after `--skip-per-file`, the ones
   earlier runs used) and `--self-prompts` the target writes, answered through the engine's
   own batched plain decoding, `--batch` sequences a forward, features recorded as they go
   (ddtree.training.data; the judged prompt files are never planned);
2. training (`--train-minutes`), continuing the shipped drafter (`--init-from`; `--layers` may
   add layers on top) with bf16 autocast, `--sequences-per-step` x `--anchors` blocks a step;
   the first FIT_PROBE_STEPS steps are timed and the cosine schedule is then as long as the clock
   allows (stage_train's `fit_after`; one run, so the features are loaded once);
3. export, then held-out tau at budget 16 and top-1 accuracy on the first `--eval-prompts` of
   each judged file for the shipped drafter and the new one (the references decoded in one
   batch on the GPU; `ddtree eval-drafter` on the CPU gives the numbers that are reported);
4. into `--out`: the new drafter in shards under 16 MiB (a device call brings back files of at
   most 16 MiB; DFlashDrafter.load reads the sharded layout), the data's tokens (prompt and
   response ids and domains, no features: a later run recomputes them with one prefill per
   sequence), and report.json.

`--tokens FILE` (repeatable) adds earlier runs' data, kept as token ids (export_tokens): their
features are made again on the GPU and training draws from them and this run's data alike
(the held-out sequences stay this run's first ones).

    python benchmarks/gpu_train.py --out OUT --prompts gsm8k-train.jsonl --skip-per-file 4400 \\
        [--data-minutes 3] [--train-minutes 3] [--batch 256] [--device cuda]

It runs on a CPU as well (tests/test_gpu_train.py runs it on a tiny model in seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree.bench import read_prompts
from ddtree.engine import shipped_drafter
from ddtree.training import TrainConfig, stage_data, stage_export, stage_train
from ddtree.cli import parse_mix
from ddtree.training.data import DEFAULT_HELD_OUT, export_tokens, render_prompt, recording_scheduler, stage_features
from ddtree.training.evaluate import drafts_report
from ddtree.training.train import FIT_PROBE_STEPS
from ddtree.workers.drafter import DFlashDrafter, default_target_layer_ids
from ddtree.workers.loading import load_target
from ddtree.workers.requests import Request

SHARD_BYTES = 15 * 2**20  # a device call brings back files of at most 16 MiB


def save_sharded(drafter_dir: Path, out: Path, max_bytes: int | None = None) -> None:
    """The exported drafter (config.json + model.safetensors) as config.json, model-0000i-of-0000n
    shards of at most `max_bytes` each and model.safetensors.index.json, the layout
    DFlashDrafter.load reads."""
    from safetensors.torch import load_file

    max_bytes = max_bytes or SHARD_BYTES
    state = load_file(str(drafter_dir / "model.safetensors"))
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        tensor = state[name].contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes:
            raise ValueError(f"{name} alone is {nbytes} bytes, over a shard's {max_bytes}")
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text((drafter_dir / "config.json").read_text())
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def judged_tau(target, drafters: dict, files, limit: int, max_tokens: int, budget: int = 16) -> dict:
    """tau at `budget` and top-1 accuracy per file for each drafter: the target's greedy
    continuations of the first `limit` prompts of each file decoded in one batch, then each
    drafter's drafts walked along them (ddtree.training.evaluate)."""
    from ddtree.engine import default_chat_template_kwargs

    tok, chat = target.tokenizer, default_chat_template_kwargs(target.directory)
    out = {}
    for path in files:
        requests = [Request(render_prompt(tok, p, chat), max_tokens, eos_token_ids=(tok.eos_token_id,))
                    for p in read_prompts(path, limit)]
        longest = max(len(r.prompt) for r in requests) + max_tokens
        outputs = [r.tokens for r in recording_scheduler(target, len(requests), longest).generate(requests)]
        for name, drafter in drafters.items():
            report = drafts_report(target, drafter, requests, outputs, [budget])
            out.setdefault(Path(path).stem, {})[name] = {"tau": report["tau"][str(budget)],
                                                         "accuracy": report["accuracy"][:3]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the drafter shards, tokens.safetensors, report.json")
    parser.add_argument("--workdir", default="/tmp/ddtree-gpu-train")
    parser.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", action="append", default=[], help="training prompts JSONL (repeatable)")
    parser.add_argument("--tokens", action="append", default=[],
                        help="an earlier run's tokens file (repeatable): its features are made again here and "
                        "it is trained on with this run's data")
    parser.add_argument("--skip-per-file", type=int, default=0)
    parser.add_argument("--limit-per-file", type=int, default=100_000)
    parser.add_argument("--self-prompts", type=int, default=3000,
                        help="prompts the target writes; written before any answer, outside --data-minutes")
    parser.add_argument("--mix", type=parse_mix, default={"code": 0.45, "chat": 0.45, "math": 0.1})
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=33, help="seeds the self-written prompts (32 seeded the CPU run kept in "
                        "benchmarks/data/drafter-tokens: another seed writes other prompts)")
    parser.add_argument("--data-minutes", type=float, default=3.0)
    parser.add_argument("--train-minutes", type=float, default=3.0)
    parser.add_argument("--init-from", default=None, help="default: the shipped drafter; 'none': the target's last layers")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--target-layers", type=int, nargs="+", default=None, help="default: the shipped drafter's")
    parser.add_argument("--mask-token-id", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20_000,
                        help="the most steps; the schedule is fitted to --train-minutes from the first steps' pace")
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--sequences-per-step", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=48)
    parser.add_argument("--vocab-floor", type=int, default=8192)
    parser.add_argument("--eval-prompts", type=int, default=20, help="first N prompts of each judged file (0: none)")
    parser.add_argument("--eval-tokens", type=int, default=128)
    args = parser.parse_args()
    began = time.time()
    out, workdir = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": vars(args) | {"mix": args.mix}, "device": args.device}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()

    def stamp(what: str) -> None:
        report.setdefault("seconds", {})[what] = round(time.time() - began, 1)
        print(f"[{time.time() - began:7.1f} s] {what}", flush=True)
        (out / "report.json").write_text(json.dumps(report, indent=1))

    target = load_target(args.model, torch.float32)
    target.model.to(args.device)
    init_from = None if args.init_from == "none" else Path(args.init_from) if args.init_from else shipped_drafter()
    layers = tuple(args.target_layers) if args.target_layers else (
        DFlashDrafter.load(init_from, target.model).target_layer_ids if init_from
        else default_target_layer_ids(target.model.config.num_hidden_layers))
    stamp("target loaded")

    left = stage_data(target, workdir, args.prompts, args.limit_per_file, args.self_prompts, layers, args.max_tokens,
                      args.batch, args.seed, mix=args.mix, held_out=DEFAULT_HELD_OUT, skip_per_file=args.skip_per_file,
                      deadline=time.time() + 60 * args.data_minutes)
    report["data"] = export_tokens(workdir, out / "tokens.safetensors") | {"shards_left": left}
    stamp(f"data: {report['data']['sequences']} sequences, {report['data']['tokens']} tokens")
    carried = 0
    for k, tokens_file in enumerate(args.tokens):  # earlier runs' data, trained on beside this one's
        carried += stage_features(target, workdir / f"carried-{k}", Path(tokens_file), layers)
        for shard in sorted((workdir / f"carried-{k}" / "data").glob("shard-*.safetensors")):
            link = workdir / "data" / f"shard-c{k}-{shard.name.split('-', 1)[1]}"
            if not link.exists():
                link.symlink_to(shard.resolve())
    if args.tokens:
        report["carried_sequences"] = carried
        stamp(f"features of {carried} carried sequences")

    cfg = TrainConfig(block_size=args.block_size, num_layers=args.layers, mask_token_id=args.mask_token_id,
                      steps=args.steps, lr=args.lr, seed=args.seed,
                      sequences_per_step=args.sequences_per_step, anchors_per_sequence=args.anchors,
                      vocab_floor=None if args.vocab_floor < 0 else args.vocab_floor,
                      checkpoint_every=250, snapshot_every=0)
    # the schedule's length from the first steps' pace: its cosine ends as the clock does
    state = stage_train(target, workdir, cfg, layers, deadline=time.time() + 60 * args.train_minutes,
                        init_from=init_from, fit_after=FIT_PROBE_STEPS)
    report["train"] = {"steps": state.step, "of": cfg.steps, "loss_ema": state.loss_ema,
                       "history": state.history[-8:], "held_out_sequences": state.held_out}
    stamp(f"trained {state.step} steps, loss {state.loss_ema:.3f}")

    exported = stage_export(target, workdir, cfg, layers, workdir / "export",
                            data_note=f"a GPU training run: {report['data']['tokens']} tokens")
    report["model_card"] = (exported / "README.md").read_text()
    save_sharded(exported, out / "drafter")
    stamp("exported")

    if args.eval_prompts:
        drafters = {"new": DFlashDrafter.load(exported, target.model).to(args.device)}
        if init_from:
            drafters["before"] = DFlashDrafter.load(init_from, target.model).to(args.device)
        report["tau16"] = judged_tau(target, drafters, DEFAULT_HELD_OUT, args.eval_prompts, args.eval_tokens)
        for name, row in report["tau16"].items():
            print(f"{name}: " + ", ".join(f"{k} tau {v['tau']:.2f}" for k, v in row.items()), flush=True)
        stamp("evaluated")
    if state.loss_ema is not None and not math.isfinite(state.loss_ema):
        raise SystemExit("training diverged (loss not finite)")


if __name__ == "__main__":
    main()
