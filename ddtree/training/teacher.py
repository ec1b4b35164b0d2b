"""The target's own next-token distributions over the data stage's sequences: soft labels for
distillation (`TrainConfig.distill`).

The data stage keeps only the target's greedy tokens: the hard label of block position k is the
token at anchor + k. The target's whole distribution at that position says more -- which other
tokens it nearly chose, and how sure it was -- and a drafter whose held-out accuracy stops
rising while its training accuracy climbs (data-bound) may learn from it what the hard labels do
not carry. The target's last layers, run once per sequence from the features the data stage
captured, give every response position's distribution; its top `top_k` (token, log-probability)
pairs are kept per token, next to the shard they belong to:

    data/teacher-00000.safetensors: ids [T, K] int32, logprobs [T, K] fp16 -- row t is the
    target's distribution over token t given tokens before it (sequences end to end, as in
    the shard; the prompt's rows, never a label, are zeros)

Stage-resumable like the others: a shard whose teacher file exists is not recomputed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..workers.loading import LoadedTarget

TEACHER_TOP_K = 32  # (token, log-prob) pairs kept per position: a median 99% of the target's mass (mean 96%)


@torch.no_grad()
def sequence_teacher(target: LoadedTarget, tokens: torch.Tensor, top_k: int, start: int = 1,
                     resume: tuple[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n, K], logprobs [n, K]) of one sequence: row t (start <= t < n) is the target's
    top-K over token t given tokens[:t]; rows before `start` (the prompt's) are zeros.

    `resume` (L, features [n, H] of layer L, as the data stage captured them): only the layers
    after L run, and the LM head only over the rows asked for -- on the shipped pair (L = 27 of
    30) about 6x less work than a whole prefill, the same top choices (fp16 features)."""
    model, n = target.model, len(tokens)
    start = max(start, 1)
    out = model(tokens[None].long(), torch.arange(n)[None], model.prefill_mask(n), model.new_cache(1, n),
                logits_to_keep=n - start + 1, resume=None if resume is None else (resume[0], resume[1][None]))
    values, ids = torch.log_softmax(out.logits[0, :-1].float(), dim=-1).topk(top_k, dim=-1)
    return (torch.cat([torch.zeros((start, top_k), dtype=torch.int32), ids.int()]),
            torch.cat([torch.zeros((start, top_k)), values]).half())


def teacher_path(shard: Path) -> Path:
    return shard.with_name(shard.name.replace("shard-", "teacher-"))


def stage_teacher(target: LoadedTarget, workdir: Path, layer_ids=(), top_k: int = TEACHER_TOP_K) -> None:
    """Writes data/teacher-*.safetensors for every shard that has none yet. With `layer_ids`
    (the layers whose outputs the shards' features hold, in their order), each sequence resumes
    from its last captured layer's features instead of running the whole target."""
    shards = [p for p in sorted((workdir / "data").glob("shard-*.safetensors")) if not teacher_path(p).is_file()]
    last = max(layer_ids) if layer_ids else None
    hidden = target.model.config.hidden_size
    column = list(layer_ids).index(last) * hidden if last is not None else 0
    for path in tqdm(shards, desc="teacher", unit="shard"):
        shard = load_file(str(path))
        offs = shard["offsets"].tolist()
        parts = []
        for (a, b), start in zip(zip(offs, offs[1:]), shard["response_starts"].tolist()):
            resume = None if last is None else (last, shard["features"][a:b, column : column + hidden])
            parts.append(sequence_teacher(target, shard["tokens"][a:b], top_k, start, resume))
        tmp = teacher_path(path).with_suffix(".tmp")
        save_file({"ids": torch.cat([p[0] for p in parts]), "logprobs": torch.cat([p[1] for p in parts])}, str(tmp))
        tmp.replace(teacher_path(path))


def load_teacher(workdir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [T, K], logprobs [T, K]) per sequence, in load_sequences' order."""
    out = []
    for path in sorted((workdir / "data").glob("shard-*.safetensors")):
        with safe_open(str(path), "pt") as shard:  # the offsets alone, not the shard's features again
            offs = shard.get_tensor("offsets").tolist()
        teacher = load_file(str(teacher_path(path)))
        out += [(teacher["ids"][a:b], teacher["logprobs"][a:b]) for a, b in zip(offs, offs[1:])]
    return out
