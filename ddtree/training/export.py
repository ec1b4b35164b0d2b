"""Stage 3 of `ddtree train-drafter`: the trained drafter as a checkpoint directory with a
model card that states its data, steps and held-out accuracy."""

from __future__ import annotations

from pathlib import Path

import torch

from ..workers.loading import LoadedTarget
from .data import load_sequences
from .teacher import TEACHER_TOP_K
from .train import TrainConfig, evaluate_accuracy, init_drafter


def frequent_vocabulary(vocab: torch.Tensor, sequences, keep: int) -> torch.Tensor:
    """The `keep` ids of `vocab` that the sequences' responses use most (ties: the lower id), sorted."""
    responses = torch.cat([tokens[start:] for tokens, _, start in sequences] or [torch.zeros(0, dtype=torch.long)])
    counts = torch.bincount(responses, minlength=int(vocab.max()) + 1)
    order = torch.sort(counts[vocab], descending=True, stable=True).indices  # vocab is sorted: ties keep id order
    return vocab[order[:keep]].sort().values


def stage_export(target: LoadedTarget, workdir: Path, cfg: TrainConfig, layer_ids, out: Path,
                 data_note: str = "", eval_summary: str = "", layout: str = "ddtree",
                 vocab_keep: int | None = None) -> Path:
    """The trained drafter in `layout` (DFlashDrafter.save: "ddtree", or "published" for other
    stacks, which refuses a drafter with a draft vocabulary) with a model card. `vocab_keep`
    cuts the draft vocabulary to the ids the data's responses use most: a cheaper head (the
    larger part of a draft's work) for the few rare tokens it could still have proposed."""
    if vocab_keep is not None and vocab_keep < 1:
        raise ValueError(f"vocab_keep must be at least 1, got {vocab_keep}")
    saved = torch.load(workdir / "train" / "checkpoint.pt", weights_only=False, map_location="cpu")
    drafter = init_drafter(target, cfg, layer_ids, saved["drafter"]).to(target.model.device)
    sequences = load_sequences(workdir)
    held_out = sequences[: saved["state"].get("held_out") or max(1, int(len(sequences) * cfg.held_out))]
    trained_vocab = drafter.config.draft_vocab_size or drafter.config.vocab_size
    cut = vocab_keep is not None and vocab_keep < trained_vocab
    if cut:  # counted over the training sequences only: the held-out accuracy below stays held out
        whole = drafter.draft_vocab.cpu() if drafter.draft_vocab is not None else torch.arange(drafter.config.vocab_size)
        drafter.set_draft_vocab(frequent_vocabulary(whole, sequences[len(held_out):], vocab_keep))
    accuracy = evaluate_accuracy(drafter.eval(), held_out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    drafter.to("cpu", torch.bfloat16).save(out, layout, tok.bos_token_id, tok.eos_token_id)
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
        f"{drafter.config.draft_vocab_size or drafter.config.vocab_size} of {drafter.config.vocab_size} tokens"
        + (f" (the ones this data's responses use most, of the {trained_vocab} it was trained with)" if cut else ""),
        *([f"- continued from the drafter saved at {state['init_from']} (trained before on its own data)"]
          if state.get("init_from") else []),
        f"- data: {n_seq} sequences, {n_tokens} tokens ({data_note or 'see the training command'}); "
        f"held out: the first {len(held_out)} sequences",
        f"- steps: {state['step']} (batch {cfg.sequences_per_step} sequences x {cfg.anchors_per_sequence} anchors), "
        f"final loss (EMA) {'-' if state['loss_ema'] is None else format(state['loss_ema'], '.3f')}",
        _loss_line(saved.get("config", {}).get("distill", 0.0)),
        f"- held-out top-1 accuracy per block position: {', '.join(f'{a:.2f}' for a in accuracy)}",
    ]
    if eval_summary:
        card += ["", eval_summary]
    (out / "README.md").write_text("\n".join(card) + "\n")
    return out


def _loss_line(distill: float) -> str:
    if not distill:
        return "- loss: cross-entropy against the target's greedy token at each block position"
    return (f"- loss: {1 - distill:g} x the cross-entropy against the target's greedy token + {distill:g} x the "
            f"cross-entropy against its own top-{TEACHER_TOP_K} distribution at each block position (soft labels)")
