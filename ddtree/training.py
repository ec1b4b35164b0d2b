"""`ddtree train-drafter`: self-distil a DFlash drafter for a target, in three resumable stages.

    workdir/
      data/shard-00000.safetensors ...   the target's greedy responses + features (stage 1)
      train/checkpoint.pt                drafter + optimizer + step (stage 2, rewritten as it goes)
      export/                            the drafter in the published DFlash format + README.md

1. data: prompts from JSONL files (`question`, `turns[0]` or `prompt`) and prompts the target
   writes itself (the chat template's opening of a user turn, sampled with temperature, after a
   short opener so chat, code and math are all covered); the target answers greedily, in batches,
   and the outputs of its layers `target_layer_ids` are captured during generation.
2. train: the DFlash recipe: random anchors inside the responses; block [token at anchor,
   MASK x (B-1)]; context features strictly before the anchor; bidirectional attention in the
   block; label at block position k = token at anchor + k; cross-entropy weighted by
   exp(-(k-1)/gamma); the target, its embedding and LM head frozen; AdamW, warmup, cosine.
3. export: the checkpoint directory (bf16 safetensors) and a model card; ddtree's layout by
   default, or exactly the published one (`--export-layout published`).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .bench import read_prompts
from .engine import default_chat_template_kwargs
from .kernels.tree import Candidates, greedy_walk, grow_tree
from .workers.drafter import DFlashConfig, DFlashDrafter, check_target_layer_ids
from .workers.loading import LoadedTarget

OPENERS = (
    "Write a Python function", "Explain", "How do I", "Solve", "What is", "Write a short story",
    "Give me tips", "Compare", "Write a SQL query", "Calculate", "Why does", "Summarize",
    "Write a JavaScript", "Translate", "Describe", "If a train",
)


@dataclass
class TrainConfig:
    block_size: int = 8
    num_layers: int = 2
    mask_token_id: int | None = None
    gamma: float = 5.0  # position weight exp(-(k-1)/gamma)
    steps: int = 3000
    sequences_per_step: int = 4
    anchors_per_sequence: int = 24
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    held_out: float = 0.05  # share of sequences kept for held-out accuracy
    checkpoint_every: int = 100
    snapshot_every: int = 1000  # keep the drafter's weights at these steps (train/snapshots/)
    # The drafter's head covers the tokens of the training data plus token ids below this floor
    # (byte-level BPE ids roughly follow merge order, so low ids are the common pieces); None: the
    # whole vocabulary. It makes the head, the costliest part of a training step, ~4x cheaper.
    vocab_floor: int | None = 8192


# --- stage 1: data ----------------------------------------------------------------------------


def self_prompts(target: LoadedTarget, count: int, seed: int, batch: int = 16, max_tokens: int = 48) -> list[str]:
    """User messages the target writes itself: the chat template up to the user's content plus
    an opener, then sampled at temperature 1 until the turn ends."""
    from transformers import AutoModelForCausalLM

    tok = target.tokenizer
    marker = "\u2063"
    rendered = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    opening = rendered[: rendered.index(marker)]
    hf = AutoModelForCausalLM.from_pretrained(target.directory, dtype=torch.float32).eval()
    tok.padding_side = "left"
    torch.manual_seed(seed)
    out = []
    with tqdm(total=count, desc="self-prompts", unit="prompt") as bar:
        while len(out) < count:
            openers = [OPENERS[(len(out) + i) % len(OPENERS)] for i in range(batch)]
            enc = tok([opening + o for o in openers], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = hf.generate(**enc, max_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_p=0.95,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            for opener, row in zip(openers, gen[:, enc["input_ids"].shape[1]:]):
                text = (opener + tok.decode(row, skip_special_tokens=True)).strip()
                if len(text) > len(opener) + 8:
                    out.append(text)
            bar.update(min(batch, count - bar.n))
    return out[:count]


@torch.inference_mode()
def generate_shard(hf, tok, messages: list[str], layer_ids, max_tokens: int, chat_kwargs: dict | None = None) -> dict:
    """Greedy responses to `messages` in one batch, with the target's features captured during
    generation (the hidden states transformers returns at each step). Returns flat tensors.
    `chat_kwargs`: the chat template's variables (the engine's default for the target)."""
    rendered = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True,
                                        **(chat_kwargs or {}))
                for m in messages]
    enc = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
    out = hf.generate(**enc, max_new_tokens=max_tokens, do_sample=False, output_hidden_states=True,
                      return_dict_in_generate=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    pad = enc["input_ids"].shape[1]
    steps = out.hidden_states  # step 0: [B, pad, H] per layer; step t: [B, 1, H]
    feats = torch.cat([torch.cat([step[i + 1] for i in layer_ids], dim=-1) for step in steps], dim=1)
    tokens, features, offsets, starts = [], [], [0], []
    for row in range(len(messages)):
        real = int(enc["attention_mask"][row].sum())
        response = out.sequences[row, pad:].tolist()
        if tok.eos_token_id in response:
            response = response[: response.index(tok.eos_token_id) + 1]
        seq = out.sequences[row, pad - real : pad + len(response)]
        # features exist for every token but the last (no step consumed it)
        f = feats[row, pad - real : pad + len(response) - 1]
        tokens.append(seq[:-1])
        features.append(f.to(torch.float16))
        starts.append(real)
        offsets.append(offsets[-1] + len(seq) - 1)
    return {
        "tokens": torch.cat(tokens).to(torch.int32),
        "features": torch.cat(features),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "response_starts": torch.tensor(starts, dtype=torch.int64),
    }


def plan_prompts(target: LoadedTarget, plan: Path, prompt_files: list[str], limit_per_file: int,
                 self_prompt_count: int, batch: int, seed: int) -> list[list[str]]:
    """The prompts of every data shard, kept in `plan` so a rerun makes the same shards. A rerun
    that asks for more (a larger --limit-per-file or --self-prompts) appends shards for the new
    prompts only; the finished shards and their prompts stay as they are."""
    shards = json.loads(plan.read_text())["shards"] if plan.is_file() else []
    planned = {m for shard in shards for m in shard}
    from_files = [m for f in prompt_files for m in read_prompts(f, limit_per_file)]
    file_set = set(from_files)
    new = list(dict.fromkeys(m for m in from_files if m not in planned))
    have_self = sum(1 for m in planned if m not in file_set)
    if self_prompt_count > have_self:
        new += self_prompts(target, self_prompt_count - have_self, seed + len(planned))
    if new:
        random.Random(seed + len(planned)).shuffle(new)
        shards += [new[i : i + batch] for i in range(0, len(new), batch)]
        tmp = plan.with_suffix(".tmp")
        tmp.write_text(json.dumps({"shards": shards}))
        tmp.replace(plan)
    return shards


def stage_data(target: LoadedTarget, workdir: Path, prompt_files: list[str], limit_per_file: int,
               self_prompt_count: int, layer_ids, max_tokens: int, batch: int, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    check_target_layer_ids(layer_ids, target.model.config.num_hidden_layers)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    shards = plan_prompts(target, data / "prompts.json", prompt_files, limit_per_file, self_prompt_count, batch, seed)
    hf = AutoModelForCausalLM.from_pretrained(target.directory, dtype=torch.float32).eval()
    tok = target.tokenizer
    tok.padding_side = "left"
    done_tokens, started = 0, time.perf_counter()
    with tqdm(total=len(shards), desc="data", unit="batch") as bar:
        for i, chunk in enumerate(shards):
            path = data / f"shard-{i:05d}.safetensors"
            if path.is_file():  # resumable: finished shards stay
                bar.update(1)
                continue
            shard = generate_shard(hf, tok, chunk, layer_ids, max_tokens, default_chat_template_kwargs(target.directory))
            tmp = path.with_suffix(".tmp")
            save_file(shard, str(tmp))
            tmp.replace(path)
            done_tokens += int(shard["tokens"].numel())
            bar.set_postfix(tokens=done_tokens, tok_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
            bar.update(1)


def load_sequences(workdir: Path) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(tokens [T], features [T, F], response start) per sequence, from every shard."""
    out = []
    for path in sorted((workdir / "data").glob("shard-*.safetensors")):
        shard = load_file(str(path))
        offs = shard["offsets"].tolist()
        for i, start in enumerate(shard["response_starts"].tolist()):
            a, b = offs[i], offs[i + 1]
            out.append((shard["tokens"][a:b].long(), shard["features"][a:b], start))
    return out


# --- stage 2: train ---------------------------------------------------------------------------


def draft_vocabulary(sequences, cfg: TrainConfig, vocab_size: int) -> torch.Tensor | None:
    """Sorted token ids for the drafter's head, or None for the whole vocabulary."""
    if cfg.vocab_floor is None or cfg.vocab_floor >= vocab_size:
        return None
    seen = torch.cat([tokens for tokens, _, _ in sequences] + [torch.arange(cfg.vocab_floor)])
    return seen.unique()


def init_drafter(target: LoadedTarget, cfg: TrainConfig, layer_ids, saved: dict | None = None) -> DFlashDrafter:
    """A drafter whose layers start as copies of the target's last layers (same shapes); with
    `saved` (a state dict from a checkpoint), that drafter instead, draft vocabulary included."""
    t = target.model.config
    config = DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        vocab_size=t.vocab_size, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, block_size=cfg.block_size,
        num_target_layers=t.num_hidden_layers, target_layer_ids=tuple(layer_ids),
        mask_token_id=cfg.mask_token_id if cfg.mask_token_id is not None else t.vocab_size - 1,
    )
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(config, target.model).float()
    source = target.model.model.layers[-cfg.num_layers:]
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, source):
            own = mine.state_dict()
            for name, tensor in theirs.state_dict().items():
                if name in own:
                    own[name].copy_(tensor)
        torch.nn.init.normal_(drafter.fc.weight, std=0.02)
        drafter.norm.weight.copy_(target.model.model.norm.weight)
    if saved is not None:
        if "draft_vocab" in saved:
            drafter.set_draft_vocab(saved["draft_vocab"])
        drafter.load_state_dict(saved)
    return drafter


def position_weights(block: int, gamma: float) -> torch.Tensor:
    return torch.exp(-(torch.arange(1, block) - 1) / gamma)


def sample_anchors(length: int, response_start: int, block: int, count: int, rng: random.Random) -> list[int]:
    """Anchors inside the response whose whole block has labels; context is never empty."""
    lo, hi = max(response_start, 1), length - block
    if hi < lo:
        return []
    return sorted(rng.sample(range(lo, hi + 1), min(count, hi - lo + 1)))


def block_loss(drafter, tokens, features, anchors, weights):
    """Weighted cross-entropy and top-1 hits per position for one sequence's blocks."""
    s = drafter.block_size
    logits = drafter.block_logits(features, tokens, anchors).float()  # [A, S-1, V_d]
    labels = drafter.draft_ids(tokens[anchors[:, None] + torch.arange(1, s)])  # [A, S-1]; -100: not in V_d
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    loss = (ce.view_as(labels) * weights).sum() / (weights.sum() * len(anchors))
    hits = (logits.argmax(-1) == labels).float().sum(0)  # [S-1]
    return loss, hits


@torch.no_grad()
def evaluate_accuracy(drafter, sequences, cfg: TrainConfig, anchors_per_sequence: int = 16) -> list[float]:
    """Held-out top-1 accuracy per block position (1 ... B-1)."""
    rng = random.Random(1234)
    weights = position_weights(cfg.block_size, cfg.gamma)
    hits, count = torch.zeros(cfg.block_size - 1), 0
    for tokens, features, start in sequences:
        anchors = sample_anchors(len(tokens), start, cfg.block_size, anchors_per_sequence, rng)
        if anchors:
            _, h = block_loss(drafter, tokens, features.float(), torch.tensor(anchors), weights)
            hits += h
            count += len(anchors)
    return (hits / max(count, 1)).tolist()


@dataclass
class TrainState:
    step: int = 0
    loss_ema: float | None = None
    history: list = field(default_factory=list)  # (step, loss_ema, acc@1)
    held_out: int = 0  # the first `held_out` sequences, fixed at the first step (data may grow)


def stage_train(target: LoadedTarget, workdir: Path, cfg: TrainConfig, layer_ids, deadline: float | None = None) -> TrainState:
    """Trains until cfg.steps or the wall-clock `deadline` (then checkpoints: run again to go on)."""
    sequences = load_sequences(workdir)
    if not sequences:
        raise ValueError(f"no data in {workdir / 'data'}: run the data stage first")
    target.model.requires_grad_(False)  # frozen: target, embedding and LM head
    ckpt_dir = workdir / "train"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False) if ckpt.is_file() else None
    state = TrainState(**saved["state"]) if saved else TrainState()
    if not state.held_out:
        state.held_out = max(1, int(len(sequences) * cfg.held_out))
    train_set = sequences[state.held_out :]  # the first sequences are held out (see stage_export)
    if saved:
        drafter = init_drafter(target, cfg, layer_ids, saved["drafter"])
    else:
        drafter = init_drafter(target, cfg, layer_ids)
        vocab = draft_vocabulary(train_set, cfg, drafter.config.vocab_size)
        if vocab is not None:
            drafter.set_draft_vocab(vocab)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    def lr_at(step):
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    if saved:
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "state": asdict(state), "config": asdict(cfg)}, tmp)
        tmp.replace(ckpt)

    weights = position_weights(cfg.block_size, cfg.gamma)
    rng = random.Random(cfg.seed * 7919 + state.step)
    drafter.train()
    started, trained_tokens = time.perf_counter(), 0
    acc = torch.zeros(cfg.block_size - 1)
    with tqdm(total=cfg.steps, initial=state.step, desc="train", unit="step") as bar:
        while state.step < cfg.steps:
            if deadline is not None and time.time() > deadline:
                break
            opt.zero_grad(set_to_none=True)
            total, hits, anchors_seen = 0.0, torch.zeros(cfg.block_size - 1), 0
            for tokens, features, start in rng.sample(train_set, min(cfg.sequences_per_step, len(train_set))):
                anchors = sample_anchors(len(tokens), start, cfg.block_size, cfg.anchors_per_sequence, rng)
                if not anchors:
                    continue
                # fp32: on this CPU bf16 autocast made the backward pass 30x slower
                loss, h = block_loss(drafter, tokens, features.float(), torch.tensor(anchors), weights)
                (loss / cfg.sequences_per_step).backward()
                total += float(loss.detach()) / cfg.sequences_per_step
                hits += h
                anchors_seen += len(anchors)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            state.step += 1
            trained_tokens += anchors_seen * (cfg.block_size - 1)
            acc = 0.9 * acc + 0.1 * hits / max(anchors_seen, 1) if state.step > 1 else hits / max(anchors_seen, 1)
            state.loss_ema = total if state.loss_ema is None else 0.98 * state.loss_ema + 0.02 * total
            bar.set_postfix(loss=f"{state.loss_ema:.3f}", acc="/".join(f"{a:.2f}" for a in acc[:4].tolist()),
                            tok_s=f"{trained_tokens / (time.perf_counter() - started):.0f}")
            bar.update(1)
            if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
                state.history.append((state.step, state.loss_ema, float(acc[0])))
                save()
            if cfg.snapshot_every and state.step % cfg.snapshot_every == 0:  # for tau against steps
                drafter.save(ckpt_dir / "snapshots" / f"step-{state.step:06d}")
    save()
    drafter.eval()
    return state


# --- stage 3: export --------------------------------------------------------------------------


def stage_export(target: LoadedTarget, workdir: Path, cfg: TrainConfig, layer_ids, out: Path,
                 data_note: str = "", eval_summary: str = "", layout: str = "ddtree") -> Path:
    """The trained drafter in `layout` (DFlashDrafter.save: "ddtree", or "published" for other
    stacks, which refuses a drafter with a draft vocabulary) with a model card."""
    saved = torch.load(workdir / "train" / "checkpoint.pt", weights_only=False)
    drafter = init_drafter(target, cfg, layer_ids, saved["drafter"])
    sequences = load_sequences(workdir)
    held_out = sequences[: saved["state"].get("held_out") or max(1, int(len(sequences) * cfg.held_out))]
    accuracy = evaluate_accuracy(drafter.eval(), held_out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    drafter.to(torch.bfloat16).save(out, layout, tok.bos_token_id, tok.eos_token_id)
    state = saved["state"]
    n_seq = len(sequences)
    n_tokens = sum(len(t) for t, _, _ in sequences)
    card = [
        f"# DFlash drafter for {target.directory.name}",
        "",
        "Trained by `ddtree train-drafter` (self-distillation: the target's own greedy responses).",
        "",
        f"- architecture: {cfg.num_layers} layers, block size {cfg.block_size}, target layers {list(layer_ids)}, "
        f"mask token {drafter.config.mask_token_id}; weights bf16; draft vocabulary "
        f"{drafter.config.draft_vocab_size or drafter.config.vocab_size} of {drafter.config.vocab_size} tokens",
        f"- data: {n_seq} sequences, {n_tokens} tokens ({data_note or 'see the training command'}); "
        f"held out: the first {len(held_out)} sequences",
        f"- steps: {state['step']} (batch {cfg.sequences_per_step} sequences x {cfg.anchors_per_sequence} anchors), "
        f"final loss (EMA) {state['loss_ema']:.3f}",
        f"- held-out top-1 accuracy per block position: {', '.join(f'{a:.2f}' for a in accuracy)}",
    ]
    if eval_summary:
        card += ["", eval_summary]
    (out / "README.md").write_text("\n".join(card) + "\n")
    return out


# --- evaluation -------------------------------------------------------------------------------


def reference_continuations(target: LoadedTarget, prompts: list[str], max_tokens: int):
    """Per prompt: the chat-templated prompt ids and the target's own greedy continuation."""
    from .config import SamplingParams
    from .workers.requests import Request

    tok = target.tokenizer
    chat = default_chat_template_kwargs(target.directory)
    requests = [
        Request(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, **chat),
                           add_special_tokens=False), max_tokens, eos_token_ids=(tok.eos_token_id,), sampling=SamplingParams())
        for p in prompts
    ]
    plain = solo_engine(target.model, None, 0, max(len(r.prompt) for r in requests) + max_tokens)
    return requests, [plain.generate([r])[0].tokens for r in tqdm(requests, desc="reference", unit="prompt")]


def solo_engine(model, drafter, budget, positions: int):
    """The engine's step loop for one request at a time, with a KV pool for `positions` tokens
    (one request alone runs exactly as it would in a batch, up to fp32 summation order)."""
    from .workers.scheduler import BatchLimits, Scheduler

    return Scheduler.local(model, drafter, budget, BatchLimits(max_num_seqs=1, kv_cache_tokens=positions + 2 * 129))


@torch.no_grad()
def _drafts_along(target: LoadedTarget, drafter, prompt: list[int], output: list[int], k: int) -> list[Candidates]:
    """The drafter's top-k candidates with the bonus at each output position i (0 ... n-2): what
    drafting there sees in generation -- the target's features of every token before it. One
    target pass over the whole sequence and the drafter's batched block forward; no tree is
    verified, because the target's choice at every node of the path is already known."""
    seq = torch.tensor(prompt + output)
    n = len(seq)
    model = target.model
    out = model(seq[None], torch.arange(n)[None], model.prefill_mask(n), model.new_cache(1, n), drafter.target_layer_ids)
    features = out.features[0]
    vocab = drafter.draft_vocab.tolist() if drafter.draft_vocab is not None else None
    drafts = []
    anchors = torch.arange(len(prompt), n - 1)
    for chunk in anchors.split(32):
        logprobs = torch.log_softmax(drafter.block_logits(features, seq, chunk).double(), dim=-1)
        for row in logprobs:
            c = Candidates.top_k(row, k)
            if vocab is not None:  # indices into the draft vocabulary -> token ids (both ascending)
                c = Candidates(c.logprobs, [[vocab[t] for t in ts] for ts in c.tokens])
            drafts.append(c)
    return drafts


def _rounds(drafts: list[Candidates], output: list[int], budget) -> int:
    """Rounds greedy speculation takes to emit `output` after its first token: each round grows
    the tree from the drafts at the bonus, accepts the deepest path matching the output (the
    target's own continuation) and moves past it and the new bonus -- as the engine's walk does.

    Example, chain: output [5, 9, 2, 7, 3]; at i = 0 (bonus 5) the drafts are 9, 2, 8: the
    path 5 -> 9 -> 2 matches, 8 does not (the target says 7), so the round emits 9, 2 and the
    bonus 7, and i = 3; at i = 3 (bonus 7) the drafts are 1, ...: nothing matches, the round
    emits the bonus 3, i = 4 = the last token: 2 rounds for the 4 tokens after the first."""
    k = 1 if budget == "chain" else budget  # candidates per depth, as the engine asks for
    i, rounds, n = 0, 0, len(output)
    while i + 1 < n:
        c = drafts[i]
        tree = grow_tree(output[i], Candidates([lp[:k] for lp in c.logprobs], [t[:k] for t in c.tokens]),
                         len(c.tokens) if budget == "chain" else budget)
        choice = torch.tensor([output[i + d + 1] if i + d + 1 < n else -1 for d in tree.depths.tolist()])
        i += len(greedy_walk(tree, choice).path)
        rounds += 1
    return rounds


def eval_drafter(target: LoadedTarget, drafter, prompts: list[str], max_tokens: int, budgets: list,
                 engine: bool = False) -> dict:
    """Held-out tau per budget and top-1 accuracy per block position, greedy.

    A round's accepted length is the deepest tree path matching the target's own continuation,
    so tau follows from that continuation and the drafts along it (one plain decode per prompt,
    then no verification at all). `engine=True` instead runs every budget through the engine
    (slow; it also checks the output is the target's) -- the two agree: see the tests."""
    requests, outputs = reference_continuations(target, prompts, max_tokens)
    if not engine:
        return drafts_report(target, drafter, requests, outputs, budgets)
    report = drafts_report(target, drafter, requests, outputs, [])
    rounds = dict.fromkeys(map(str, budgets), 0)
    for b in budgets:
        for req, output in zip(requests, outputs):
            result = solo_engine(target.model, drafter, b, len(req.prompt) + max_tokens).generate([req])[0]
            assert result.tokens == output, "speculation changed a token: not lossless"
            rounds[str(b)] += len(result.rounds)
    return report | {"tau": _tau(outputs, rounds)}


def _tau(outputs: list[list[int]], rounds: dict) -> dict:
    """Tokens emitted after each output's first (the prefill's) per round, per budget."""
    emitted = sum(len(o) - 1 for o in outputs)
    return {b: emitted / r if r else 0.0 for b, r in rounds.items()}


def drafts_report(target: LoadedTarget, drafter, requests, outputs: list[list[int]], budgets: list) -> dict:
    """tau per budget by walking the drafts along the reference `outputs`, and top-1 accuracy
    per block position over every position of them."""
    k = max([1] + [b for b in budgets if b != "chain"])
    hits, counts = [0] * (drafter.block_size - 1), [0] * (drafter.block_size - 1)
    rounds = dict.fromkeys(map(str, budgets), 0)
    for req, output in tqdm(list(zip(requests, outputs)), desc="eval", unit="prompt"):
        drafts = _drafts_along(target, drafter, req.prompt, output, k)
        for i, c in enumerate(drafts):
            for d, ts in enumerate(c.tokens, start=1):
                if i + d < len(output):
                    hits[d - 1] += ts[0] == output[i + d]
                    counts[d - 1] += 1
        for b in budgets:
            rounds[str(b)] += _rounds(drafts, output, b)
    return {"tau": _tau(outputs, rounds), "accuracy": [h / c if c else 0.0 for h, c in zip(hits, counts)], "prompts": len(requests)}
