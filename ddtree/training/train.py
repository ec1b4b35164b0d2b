"""Stage 2 of `ddtree train-drafter`: train the drafter on the data stage's shards.

The DFlash recipe: random anchors inside the responses; block [token at anchor, MASK x (B-1)];
context features strictly before the anchor; bidirectional attention in the block; label at
block position k = token at anchor + k; cross-entropy weighted by exp(-(k-1)/gamma) -- with `distill` > 0 mixed with the cross-entropy against the target's own
distribution at that position (teacher.py); the target, its embedding and LM head frozen; AdamW, linear warmup, cosine decay to a tenth of the peak
learning rate. train/checkpoint.pt is rewritten as it goes, so a run stopped anywhere resumes.

The drafter trains where the target's weights are: on a GPU every sequence's tokens and features
are moved there once, and the forward and backward passes run under bf16 autocast (`autocast`;
on this CPU fp32, where bf16 made the backward pass 30x slower).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from ..workers.drafter import DFlashConfig, DFlashDrafter
from ..workers.loading import LoadedTarget
from .data import load_sequences
from .teacher import load_teacher, stage_teacher

MIN_LR_RATE = 0.1  # the learning rate at the last step, as a share of the peak
FIT_PROBE_STEPS = 40  # steps timed before a schedule is fitted to the clock (stage_train's fit_after)


@dataclass
class TrainConfig:
    block_size: int = 8
    num_layers: int = 2
    mask_token_id: int | None = None
    gamma: float = 5.0  # position weight exp(-(k-1)/gamma)
    # Share of the loss taken by the soft labels (the target's top-K distribution at each block
    # position, teacher.py) instead of the hard ones (its greedy token); 0: hard labels only.
    distill: float = 0.0
    steps: int = 3000
    sequences_per_step: int = 4
    anchors_per_sequence: int = 24
    lr: float = 6e-4  # the peak, reached after `warmup` steps; cosine decay to lr * MIN_LR_RATE at `steps`
    warmup: int = 100  # steps of linear warmup from 0
    weight_decay: float = 0.01
    seed: int = 0
    held_out: float = 0.05  # share of sequences kept for held-out accuracy
    checkpoint_every: int = 100
    snapshot_every: int = 1000  # keep the drafter's weights at these steps (train/snapshots/)
    # The drafter's head covers the tokens of the training data plus token ids below this floor
    # (byte-level BPE ids roughly follow merge order, so low ids are the common pieces); None: the
    # whole vocabulary. It makes the head, the costliest part of a training step, ~4x cheaper.
    vocab_floor: int | None = 8192
    # The dtype the passes autocast to ("bfloat16"), or None: fp32. None picks bf16 on a GPU.
    autocast: str | None = None


def lr_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 to cfg.lr over cfg.warmup steps, then cosine decay to
    cfg.lr * MIN_LR_RATE at cfg.steps. Its state_dict holds the step and the peak, not the shape,
    so a run resumed with more steps follows the longer schedule from where it stopped."""
    return get_cosine_with_min_lr_schedule_with_warmup(opt, cfg.warmup, cfg.steps, min_lr_rate=MIN_LR_RATE)


def draft_vocabulary(sequences, cfg: TrainConfig, vocab_size: int) -> torch.Tensor | None:
    """Sorted token ids for the drafter's head, or None for the whole vocabulary."""
    if cfg.vocab_floor is None or cfg.vocab_floor >= vocab_size:
        return None
    seen = torch.cat([tokens for tokens, _, _ in sequences] + [torch.arange(cfg.vocab_floor)])
    return seen.unique()


def init_drafter(target: LoadedTarget, cfg: TrainConfig, layer_ids, saved: dict | None = None) -> DFlashDrafter:
    """A drafter whose layers start as copies of the target's last layers (same shapes); with
    `saved` (a state dict from a checkpoint), that drafter instead, draft vocabulary included --
    and if it has fewer layers, the missing ones on top start as identities (their output
    projections zero), so the grown drafter begins exactly where the saved one was."""
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
        grown = range(1 + max((int(k.split(".")[1]) for k in saved if k.startswith("layers.")), default=-1),
                      len(drafter.layers))
        with torch.no_grad():  # layers added on top start as identities: the grown drafter drafts as the saved one
            for i in grown:
                drafter.layers[i].self_attn.o_proj.weight.zero_()
                drafter.layers[i].mlp.down_proj.weight.zero_()
        missing, unexpected = drafter.load_state_dict(saved, strict=False)
        added = tuple(f"layers.{i}." for i in grown)
        if unexpected or set(missing) != {k for k in drafter.state_dict() if k.startswith(added)}:
            raise ValueError(f"the saved drafter does not fit a {len(drafter.layers)}-layer drafter "
                             f"(missing {missing}, unexpected {unexpected})")
    return drafter


def continued_state(target: LoadedTarget, cfg: TrainConfig, layer_ids, directory: Path) -> dict:
    """The fp32 state dict of a saved drafter (DFlashDrafter.load) to continue training from, in
    a later training run on new data. Its shape must be the one `cfg` and `layer_ids` describe, except
    that `cfg` may have more layers: init_drafter adds them on top, as identities."""
    drafter = DFlashDrafter.load(directory, target.model)
    c = drafter.config
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else target.model.config.vocab_size - 1
    mine = (cfg.block_size, tuple(layer_ids), mask)
    theirs = (c.block_size, tuple(c.target_layer_ids), c.mask_token_id)
    if mine != theirs:
        raise ValueError(f"{directory}: (block size, target layers, mask token) {theirs} differ from this run's {mine}")
    if c.num_hidden_layers > cfg.num_layers:
        raise ValueError(f"{directory}: its {c.num_hidden_layers} layers differ from this run's {cfg.num_layers} "
                         f"(a run may add layers to a saved drafter, not drop them)")
    return {k: t.float() if t.is_floating_point() else t for k, t in drafter.state_dict().items()}


def position_weights(block: int, gamma: float) -> torch.Tensor:
    return torch.exp(-(torch.arange(1, block) - 1) / gamma)


def sample_anchors(length: int, response_start: int, block: int, count: int, rng: random.Random) -> list[int]:
    """Anchors inside the response whose whole block has labels; context is never empty."""
    lo, hi = max(response_start, 1), length - block
    if hi < lo:
        return []
    return sorted(rng.sample(range(lo, hi + 1), min(count, hi - lo + 1)))


def block_loss(drafter, tokens, features, anchors, weights, teacher=None, distill: float = 0.0):
    """Weighted cross-entropy and top-1 hits per position for one sequence's blocks.

    With `teacher` (ids [T, K], logprobs [T, K]: the target's top-K at every token of the
    sequence, teacher.py) and `distill` > 0, each position's loss is (1 - distill) x the hard
    cross-entropy + distill x the cross-entropy against the target's distribution there,
    renormalised over its top-K tokens that the draft vocabulary holds."""
    s = drafter.block_size
    logits = drafter.block_logits(features, tokens, anchors).float()  # [A, S-1, V_d]
    positions = anchors[:, None] + torch.arange(1, s, device=anchors.device)  # [A, S-1]
    labels = drafter.draft_ids(tokens[positions])  # [A, S-1]; -100: not in V_d
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    per_position = ce.view_as(labels)
    if teacher is not None and distill > 0:
        ids = drafter.draft_ids(teacher[0][positions].long())  # [A, S-1, K]; -100: not in V_d
        probs = teacher[1][positions].float().exp() * (ids >= 0)
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
        soft = -(probs * torch.log_softmax(logits, dim=-1).gather(-1, ids.clamp_min(0))).sum(-1)
        per_position = (1 - distill) * per_position + distill * soft
    loss = (per_position * weights).sum() / (weights.sum() * len(anchors))
    hits = (logits.argmax(-1) == labels).float().sum(0)  # [S-1]
    return loss, hits


def autocast(cfg: TrainConfig, device: torch.device):
    """The context the drafter's passes run in: bf16 autocast on a GPU (or as cfg.autocast says)."""
    name = cfg.autocast or ("bfloat16" if device.type == "cuda" else None)
    if name is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, name))


@torch.no_grad()
def evaluate_accuracy(drafter, sequences, cfg: TrainConfig, anchors_per_sequence: int = 16) -> list[float]:
    """Held-out top-1 accuracy per block position (1 ... B-1), where the drafter's weights are."""
    device = drafter.fc.weight.device
    rng = random.Random(1234)
    weights = position_weights(cfg.block_size, cfg.gamma).to(device)
    hits, count = torch.zeros(cfg.block_size - 1, device=device), 0
    for tokens, features, start in sequences:
        anchors = sample_anchors(len(tokens), start, cfg.block_size, anchors_per_sequence, rng)
        if anchors:
            with autocast(cfg, device):
                _, h = block_loss(drafter, tokens.to(device), features.to(device).float(),
                                  torch.tensor(anchors, device=device), weights)
            hits += h
            count += len(anchors)
    return (hits / max(count, 1)).tolist()


@dataclass
class TrainState:
    step: int = 0
    loss_ema: float | None = None
    history: list = field(default_factory=list)  # (step, loss_ema, acc@1)
    held_out: int = 0  # the first `held_out` sequences, fixed at the first step (data may grow)
    init_from: str | None = None  # the saved drafter this run continued (None: the target's last layers)


def stage_train(target: LoadedTarget, workdir: Path, cfg: TrainConfig, layer_ids, deadline: float | None = None,
                init_from: Path | None = None, fit_after: int | None = None) -> TrainState:
    """Trains until cfg.steps or the wall-clock `deadline` (then checkpoints: run again to go on),
    where the target's weights are (module docstring).

    `fit_after` (with a deadline): after that many steps of this run, cfg.steps becomes as many
    steps as the deadline leaves room for at their pace (at most cfg.steps), so the cosine ends as
    the clock does; the schedule keeps its step and peak (as a resumed run's does).

    A new run starts from the target's last layers, or, with `init_from`, from that saved drafter
    (an earlier run's, trained on other data; the machine need not keep that data): its
    weights, and a draft vocabulary that adds this data's tokens to its own. A run resumed from
    its checkpoint ignores `init_from`."""
    sequences = load_sequences(workdir)
    if not sequences:
        raise ValueError(f"no data in {workdir / 'data'}: run the data stage first")
    if cfg.distill > 0:
        stage_teacher(target, workdir, layer_ids)
        teachers = load_teacher(workdir)
    else:
        teachers = [None] * len(sequences)
    target.model.requires_grad_(False)  # frozen: target, embedding and LM head
    device = target.model.device
    ckpt_dir = workdir / "train"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False, map_location="cpu") if ckpt.is_file() else None
    state = TrainState(**saved["state"]) if saved else TrainState()
    if not state.held_out:
        state.held_out = max(1, int(len(sequences) * cfg.held_out))
    train_set = sequences[state.held_out :]  # the first sequences are held out (see stage_export)
    train_teachers = teachers[state.held_out :]
    if saved:
        drafter = init_drafter(target, cfg, layer_ids, saved["drafter"])
    else:
        start = continued_state(target, cfg, layer_ids, init_from) if init_from else None
        drafter = init_drafter(target, cfg, layer_ids, start)
        state.init_from = str(init_from) if init_from else None
        vocab = draft_vocabulary(train_set, cfg, drafter.config.vocab_size)
        if vocab is not None:
            if drafter.draft_vocab is not None:  # the head is the target's, frozen: widening it trains nothing away
                vocab = torch.cat([vocab, drafter.draft_vocab]).unique()
            drafter.set_draft_vocab(vocab)
    drafter.to(device)
    if device.type != "cpu":  # once, rather than each step's sequences (~3.5 GB per million tokens)
        train_set = [(tokens.to(device), features.to(device), start) for tokens, features, start in train_set]
        train_teachers = [None if t is None else tuple(x.to(device) for x in t) for t in train_teachers]
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = lr_schedule(opt, cfg)
    if saved:
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "state": asdict(state), "config": asdict(cfg)}, tmp)
        tmp.replace(ckpt)

    weights = position_weights(cfg.block_size, cfg.gamma).to(device)
    rng = random.Random(cfg.seed * 7919 + state.step)
    drafter.train()
    started, trained_tokens = time.perf_counter(), 0
    began, first_step = time.time(), state.step
    acc = torch.zeros(cfg.block_size - 1)
    with tqdm(total=cfg.steps, initial=state.step, desc="train", unit="step") as bar:
        while state.step < cfg.steps:
            if deadline is not None and time.time() > deadline:
                break
            opt.zero_grad(set_to_none=True)
            total, hits, anchors_seen = torch.zeros((), device=device), torch.zeros(cfg.block_size - 1, device=device), 0
            for i in rng.sample(range(len(train_set)), min(cfg.sequences_per_step, len(train_set))):
                tokens, features, start = train_set[i]
                anchors = sample_anchors(len(tokens), start, cfg.block_size, cfg.anchors_per_sequence, rng)
                if not anchors:
                    continue
                with autocast(cfg, device):
                    loss, h = block_loss(drafter, tokens, features.float(), torch.tensor(anchors, device=device),
                                         weights, train_teachers[i], cfg.distill)
                (loss / cfg.sequences_per_step).backward()
                total += loss.detach() / cfg.sequences_per_step  # read once a step: a GPU does not wait per sequence
                hits += h
                anchors_seen += len(anchors)
            total, hits = float(total), hits.cpu()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            state.step += 1
            if fit_after and deadline is not None and state.step - first_step == fit_after:
                pace = (time.time() - began) / fit_after
                cfg.steps = max(state.step, min(cfg.steps, state.step + int(0.95 * (deadline - time.time()) / pace)))
                fitted = lr_schedule(opt, cfg)
                fitted.load_state_dict(sched.state_dict())
                sched = fitted
                bar.total = cfg.steps
                print(f"{1000 * pace:.0f} ms a step: a schedule of {cfg.steps} steps", flush=True)
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
