"""Stage 1 of `ddtree train-drafter`: the training data.

The prompts come from JSONL files and from the target itself (`self_prompts`); `plan_prompts`
fixes which prompts go in which shard (data/prompts.json), so a rerun makes the same shards and
a grown run only appends. Each shard holds the target's greedy responses to one batch of prompts
and the outputs of its layers `target_layer_ids` at every token, captured during generation:

    data/shard-00000.safetensors: tokens [T] int32 (prompt + response, every sequence of the
    shard end to end), features [T, len(layer_ids) * H] fp16, offsets [S+1] int64 (sequence s is
    tokens[offsets[s]:offsets[s+1]]), response_starts [S] int64 (the response's first index
    within its sequence)
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..bench import read_prompts
from ..engine import default_chat_template_kwargs
from ..workers.drafter import check_target_layer_ids
from ..workers.loading import LoadedTarget

OPENERS = (
    "Write a Python function", "Explain", "How do I", "Solve", "What is", "Write a short story",
    "Give me tips", "Compare", "Write a SQL query", "Calculate", "Why does", "Summarize",
    "Write a JavaScript", "Translate", "Describe", "If a train",
)



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
