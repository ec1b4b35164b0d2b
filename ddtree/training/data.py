"""Stage 1 of `ddtree train-drafter`: the training data.

The prompts come from JSONL files (their domain is the file's name, e.g. gsm8k-train) and from
the target itself (`self_prompts`: user messages it writes after an opener of a domain -- code,
chat, math -- in the proportions of `mix`). `plan_prompts` fixes which prompts go in which shard
(data/prompts.json, which also records each prompt's domain and the mix), so a rerun makes the
same shards and a grown run only appends. No prompt of the held-out files (the judged
evaluation sets, `DEFAULT_HELD_OUT`) is ever planned.

The target answers through the engine's own step loop -- continuous batching, plain greedy
decoding, `batch` sequences per forward -- and the scheduler records the outputs of layers
`target_layer_ids` at every token as it goes (Scheduler(record_features=...)). Each shard holds
one batch of prompts:

    data/shard-00000.safetensors: tokens [T] int32 (prompt + response, every sequence of the
    shard end to end), features [T, len(layer_ids) * H] fp16, offsets [S+1] int64 (sequence s is
    tokens[offsets[s]:offsets[s+1]]), response_starts [S] int64 (the response's first index
    within its sequence)
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..bench import read_prompts
from ..config import SamplingParams
from ..engine import default_chat_template_kwargs
from ..workers.drafter import check_target_layer_ids
from ..workers.loading import LoadedTarget
from ..workers.requests import Request
from ..workers.scheduler import BatchLimits, Scheduler

# What the target is asked to continue, per domain, when it writes its own prompts.
OPENERS = {
    "code": (
        "Write a Python function", "Complete this Python function:\n\n```python\ndef ", "Write a JavaScript function",
        "Write a SQL query", "Fix the bug in this Python code:\n\n```python\n", "Implement a Python class",
        "Write a Python script that", "Explain what this Python code does:\n\n```python\n",
    ),
    "chat": (
        "Explain", "How do I", "Write a short story", "Give me tips", "Compare", "Why does", "Summarize",
        "Translate", "Describe", "Write an email", "What are the pros and cons of", "Write a poem",
        # open chat is more than questions -- role play, what-ifs,
        # estimates, advice, longer writing (the kinds of request a chat assistant gets)
        "Imagine you are", "What would happen if", "How many", "Write a blog post about", "Help me plan",
        "What is the difference between", "Pretend to be", "Write a persuasive", "Can you recommend",
        "Write a speech", "What should I do if", "Tell me about",
    ),
    "math": ("Solve", "Calculate", "If a train", "What is"),
}
DEFAULT_MIX = {"code": 0.4, "chat": 0.4, "math": 0.2}  # the self-written prompts' shares by domain
SELF_PROMPT_TOKENS = 48  # a self-written prompt's length at most
# The judged evaluation sets: nothing of theirs may enter training (read when this checkout has them).
BENCHMARK_DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
DEFAULT_HELD_OUT = tuple(BENCHMARK_DATA / f for f in ("gsm8k-test.jsonl", "humaneval.jsonl", "vicuna-bench.jsonl"))


def held_out_texts(paths) -> set[str]:
    """Every user message of the held-out files (question, prompt, every turn), whitespace-normalized."""
    texts = set()
    for path in paths:
        path = Path(path)
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                for text in [row.get("question"), row.get("prompt"), *(row.get("turns") or [])]:
                    if text:
                        texts.add(_normal(text))
    return texts


def _normal(text: str) -> str:
    return " ".join(text.split())


def recording_scheduler(target: LoadedTarget, batch: int, positions: int, layer_ids=(), waiting: int | None = None
                        ) -> Scheduler:
    """The engine's step loop for plain decoding of `batch` sequences at once, each of at most
    `positions` tokens, recording the outputs of `layer_ids` (none: text only); `waiting`
    requests may queue behind them (default: one more batch). The target runs where its weights
    are (a GPU: prompts are prefilled 4096 tokens a step rather than 512, since a step there
    costs its launches more than its rows)."""
    prefill = 512 if target.model.device.type == "cpu" else 4096
    limits = BatchLimits(max_num_seqs=batch, max_waiting=batch if waiting is None else waiting,
                         max_prefill_tokens=prefill, max_step_tokens=max(1024, batch, prefill),
                         kv_cache_tokens=batch * (positions + 16))
    return Scheduler.local(target.model, None, 0, limits, record_features=tuple(layer_ids))


def self_prompts(target: LoadedTarget, counts: dict[str, int], seed: int, batch: int = 32) -> list[dict]:
    """User messages the target writes itself, `counts[domain]` per domain: the chat template up
    to the user's content plus an opener of the domain, then sampled (temperature 1, top-p 0.95,
    seeded) until the turn ends. Returns {"prompt", "domain"} entries."""
    tok = target.tokenizer
    marker = "\u2063"
    rendered = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    opening = rendered[: rendered.index(marker)]
    wanted = [(domain, OPENERS[domain][i % len(OPENERS[domain])]) for domain, n in counts.items() for i in range(n)]
    out = []
    with tqdm(total=len(wanted), desc="self-prompts", unit="prompt") as bar:
        attempt = 0
        while wanted:
            requests = [Request(tok.encode(opening + opener, add_special_tokens=False), SELF_PROMPT_TOKENS,
                                eos_token_ids=(tok.eos_token_id,),
                                sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed + attempt * 100_003 + i))
                        for i, (_, opener) in enumerate(wanted)]
            longest = max(len(r.prompt) for r in requests) + SELF_PROMPT_TOKENS
            results = recording_scheduler(target, batch, longest, waiting=len(requests)).generate(requests)
            retry = []
            for (domain, opener), result in zip(wanted, results):
                text = (opener + tok.decode(result.tokens, skip_special_tokens=True)).strip()
                if len(text) > len(opener) + 8:
                    out.append({"prompt": text, "domain": domain})
                    bar.update(1)
                else:  # too short to be a message: sampled again with the next seeds
                    retry.append((domain, opener))
            wanted, attempt = retry, attempt + 1
    return out


def render_prompt(tok, message: str, chat_kwargs: dict) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True,
                                   **chat_kwargs)
    return tok.encode(text, add_special_tokens=False)


def write_shard(path: Path, tokens: list[torch.Tensor], features: list[torch.Tensor], starts: list[int]) -> None:
    """One shard (module docstring) of sequences' tokens [T] and features [T, F], written whole
    or not at all (a temporary file renamed over it): a stage stopped mid-write leaves no half
    shard for a resumed run to skip."""
    lengths = torch.tensor([0] + [len(t) for t in tokens], dtype=torch.int64)
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": torch.cat(tokens).to(torch.int32), "features": torch.cat(features).to("cpu", torch.float16),
               "offsets": lengths.cumsum(0), "response_starts": torch.tensor(starts, dtype=torch.int64)}, str(tmp))
    tmp.replace(path)


def write_results(path: Path, requests: list[Request], results) -> None:
    """A shard of recorded results: the prompt and response, features for every token but the
    last (no step consumed it)."""
    seqs = [request.prompt + result.tokens for request, result in zip(requests, results)]
    assert all(result.features.shape[0] == len(seq) - 1 for seq, result in zip(seqs, results))
    write_shard(path, [torch.tensor(seq[:-1], dtype=torch.int32) for seq in seqs], [r.features for r in results],
                [len(request.prompt) for request in requests])


def _split(count: int, mix: dict[str, float]) -> dict[str, int]:
    """`count` by the shares of `mix` (largest remainders), e.g. 10 by {a: .5, b: .3, c: .2} -> 5, 3, 2."""
    total = sum(mix.values())
    exact = {d: count * w / total for d, w in mix.items()}
    out = {d: int(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: out[d] - exact[d])[: count - sum(out.values())]:
        out[d] += 1
    return out


def plan_prompts(target: LoadedTarget | None, plan: Path, prompt_files: list[str], limit_per_file: int,
                 self_prompt_count: int, batch: int, seed: int, mix: dict[str, float] | None = None,
                 held_out=DEFAULT_HELD_OUT, skip_per_file: int = 0) -> list[list[dict]]:
    """The prompts of every data shard ({"prompt", "domain"} entries), kept in `plan` so a rerun
    makes the same shards. A rerun that asks for more (a larger --limit-per-file or
    --self-prompts) appends shards for the new prompts only; the finished shards and their
    prompts stay as they are. Each file gives its prompts `skip_per_file` to `skip_per_file +
    limit_per_file` (a later training run takes prompts an earlier one did not). A prompt of a
    `held_out` file is never planned."""
    mix = mix or DEFAULT_MIX
    saved = json.loads(plan.read_text()) if plan.is_file() else {}
    shards = saved.get("shards", [])
    planned = {e["prompt"] for shard in shards for e in shard}
    forbidden = held_out_texts(held_out)
    from_files = [{"prompt": m, "domain": Path(f).stem} for f in prompt_files
                  for m in read_prompts(f, skip_per_file + limit_per_file)[skip_per_file:]]
    dropped = [e for e in from_files if _normal(e["prompt"]) in forbidden]
    if dropped:
        print(f"data plan: {len(dropped)} prompts of the training files are in the held-out files; left out")
    new = list({e["prompt"]: e for e in from_files
                if e["prompt"] not in planned and _normal(e["prompt"]) not in forbidden}.values())
    file_prompts = {e["prompt"] for e in from_files}
    have = {d: sum(1 for shard in shards for e in shard if e["domain"] == d and e["prompt"] not in file_prompts)
            for d in mix}
    wanted = {d: n - have[d] for d, n in _split(self_prompt_count, mix).items() if n > have[d]}
    if wanted:
        written = self_prompts(target, wanted, seed + len(planned), batch)
        new += [e for e in written if e["prompt"] not in planned and _normal(e["prompt"]) not in forbidden]
    if new:
        random.Random(seed + len(planned)).shuffle(new)
        shards += [new[i : i + batch] for i in range(0, len(new), batch)]
        domains: dict[str, int] = {}
        for e in (e for shard in shards for e in shard):
            domains[e["domain"]] = domains.get(e["domain"], 0) + 1
        tmp = plan.with_suffix(".tmp")
        tmp.write_text(json.dumps({"mix": domains, "self_prompt_shares": mix, "shards": shards}))
        tmp.replace(plan)
    return shards


def stage_data(target: LoadedTarget, workdir: Path, prompt_files: list[str], limit_per_file: int,
               self_prompt_count: int, layer_ids, max_tokens: int, batch: int, seed: int,
               mix: dict[str, float] | None = None, held_out=DEFAULT_HELD_OUT, skip_per_file: int = 0,
               deadline: float | None = None) -> int:
    """Plans the prompts, then generates every shard not on disk yet through one recording
    scheduler: the next shards' prompts join as places free up, and a shard is written as soon
    as its last sequence ends (resumable: finished shards stay). At the wall-clock `deadline`
    (time.time()) it stops where it is: the shards under way are lost, a rerun makes them.
    Returns the shards still to make."""
    check_target_layer_ids(layer_ids, target.model.config.num_hidden_layers)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    shards = plan_prompts(target, data / "prompts.json", prompt_files, limit_per_file, self_prompt_count, batch, seed,
                          mix, held_out, skip_per_file)
    tok = target.tokenizer
    chat = default_chat_template_kwargs(target.directory)
    todo = [i for i in range(len(shards)) if not (data / f"shard-{i:05d}.safetensors").is_file()]
    requests = {i: [Request(render_prompt(tok, e["prompt"], chat), max_tokens, eos_token_ids=(tok.eos_token_id,))
                    for e in shards[i]] for i in todo}
    longest = max((len(r.prompt) for rs in requests.values() for r in rs), default=0) + max_tokens
    scheduler = recording_scheduler(target, batch, longest, layer_ids)
    queue = deque((i, j) for i in todo for j in range(len(requests[i])))
    where: dict[int, tuple[int, int]] = {}  # sequence id -> (shard, index in the shard)
    results = {i: [None] * len(requests[i]) for i in todo}
    left = {i: len(requests[i]) for i in todo}
    done_tokens, started = 0, time.perf_counter()
    with tqdm(total=len(shards), initial=len(shards) - len(todo), desc="data", unit="shard") as bar:
        while queue or where:
            if deadline is not None and time.time() > deadline:
                break
            while queue and len(where) < 2 * batch:  # places, and one batch waiting behind them
                i, j = queue.popleft()
                where[scheduler.add(requests[i][j])] = (i, j)
            for seq_id, update in scheduler.step():
                done_tokens += len(update.new_tokens)
                if update.result is None:
                    continue
                i, j = where.pop(seq_id)
                results[i][j] = update.result
                left[i] -= 1
                if left[i] == 0:
                    write_results(data / f"shard-{i:05d}.safetensors", requests[i], results.pop(i))
                    bar.update(1)
            bar.set_postfix(tokens=done_tokens, tok_s=f"{done_tokens / (time.perf_counter() - started):.0f}")
    return len(results)


def plan_shards(workdir: Path) -> list[Path]:
    """The data stage's own shards (shard-00000 ...: a plan's), not those linked in from elsewhere."""
    return sorted(p for p in (workdir / "data").glob("shard-*.safetensors") if p.stem.split("-", 1)[1].isdigit())


def export_tokens(workdir: Path, path: Path) -> dict:
    """The data stage's sequences as token ids alone -- tokens (uint16 where every id fits, else
    int32), offsets [S+1], response_starts [S], domains [S] (indices into the `domains` metadata,
    from data/prompts.json; "unknown" for data made from a tokens file) -- a few bytes a token where
    the features are ~3.4 KB: what a later training run anywhere needs to make them again
    (`stage_features`). Returns counts for a report."""
    plans = workdir / "data" / "prompts.json"
    plan = json.loads(plans.read_text()) if plans.is_file() else None
    names = sorted({e["domain"] for shard in plan["shards"] for e in shard}) if plan else ["unknown"]
    tokens, offsets, starts, domains = [], [0], [], []
    for path_ in plan_shards(workdir):
        shard = load_file(str(path_))
        offs = shard["offsets"].tolist()
        tokens.append(shard["tokens"])
        for a, b in zip(offs, offs[1:]):
            offsets.append(offsets[-1] + b - a)
        starts += shard["response_starts"].tolist()
        if plan:
            domains += [names.index(e["domain"]) for e in plan["shards"][int(path_.stem.split("-")[1])]]
        else:
            domains += [0] * (len(offs) - 1)
    ids = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int32)
    small = len(ids) == 0 or int(ids.max()) < 2**16
    save_file({"tokens": ids.to(torch.uint16 if small else torch.int32),
               "offsets": torch.tensor(offsets, dtype=torch.int64),
               "response_starts": torch.tensor(starts, dtype=torch.int64),
               "domains": torch.tensor(domains, dtype=torch.int64)}, str(path), metadata={"domains": json.dumps(names)})
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    return {"sequences": len(starts), "tokens": len(ids),
            "by_domain": {d: domains.count(i) for i, d in enumerate(names)},
            "response_tokens": {d: sum(n - s for n, s, k in zip(lengths, starts, domains) if k == i)
                                for i, d in enumerate(names)}}


def stage_features(target: LoadedTarget, workdir: Path, tokens_file: Path, layer_ids, per_shard: int = 256) -> int:
    """The data stage from token ids alone (a tokens file as `export_tokens` writes it: tokens,
    offsets [S+1], response_starts [S]): each sequence's features recomputed with one prefill of
    the target (up to the last captured layer), into shards of `per_shard` sequences in the data
    stage's format (resumable: finished shards stay). A prefill's features are the ones decoding
    recorded, up to fp32 summation order. Returns the sequences written."""
    check_target_layer_ids(layer_ids, target.model.config.num_hidden_layers)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    source = load_file(str(tokens_file))
    offsets, starts = source["offsets"].tolist(), source["response_starts"].tolist()
    model, written = target.model, 0
    for first in tqdm(range(0, len(starts), per_shard), desc="features", unit="shard"):
        path = data / f"shard-{first // per_shard:05d}.safetensors"
        if path.is_file():
            continue
        tokens, features = [], []
        for s in range(first, min(first + per_shard, len(starts))):
            seq = source["tokens"][offsets[s]:offsets[s + 1]].to(torch.int64)
            n = len(seq)
            on = seq.to(model.device)
            out = model(on[None], torch.arange(n, device=model.device)[None], model.prefill_mask(n),
                        model.new_cache(1, n), capture_layers=tuple(layer_ids), features_only=True)
            tokens.append(seq)
            features.append(out.features[0].to("cpu", torch.float16))
        write_shard(path, tokens, features, starts[first:first + len(tokens)])
        written += len(tokens)
    return written


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
