"""`ddtree eval-drafter`: a drafter's held-out tau per budget and top-1 accuracy per block
position, greedy; with `lookup`, also tau with lookup branches (workers.lookup) in the trees.

A round's accepted length is the deepest tree path matching the target's own continuation, so
tau follows from that continuation and the drafts along it: one plain decode per prompt
(`reference_continuations`), one target pass and the drafter's block forward per prompt
(`_drafts_along`), then trees walked without verification (`_rounds`). A lookup branch needs no
model at all: the context so far, and a calibration that learns over the prompts in order, as
an engine's does over the requests it serves.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..config import SamplingParams
from ..engine import default_chat_template_kwargs
from ..kernels.tree import Candidates, walk_tree, grow_tree
from ..workers.loading import LoadedTarget
from ..workers.lookup import BATCH_DECAY, LookupCalibration, SequenceLookup
from ..workers.requests import Request
from ..workers.scheduler import BatchLimits, Scheduler


def reference_continuations(target: LoadedTarget, prompts: list[str], max_tokens: int):
    """Per prompt: the chat-templated prompt ids and the target's own greedy continuation."""
    tok = target.tokenizer
    chat = default_chat_template_kwargs(target.directory)
    requests = [
        Request(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, **chat),
                           add_special_tokens=False), max_tokens, eos_token_ids=(tok.eos_token_id,), sampling=SamplingParams())
        for p in prompts
    ]
    plain = solo_engine(target.model, None, 0, max(len(r.prompt) for r in requests) + max_tokens)
    return requests, [plain.generate([r])[0].tokens for r in tqdm(requests, desc="reference", unit="prompt")]


def solo_engine(model, drafter, budget, positions: int, lookup: bool = False):
    """The engine's step loop for one request at a time, with a KV pool for `positions` tokens
    (one request alone runs exactly as it would in a batch, up to fp32 summation order)."""
    return Scheduler.local(model, drafter, budget, BatchLimits(max_num_seqs=1, kv_cache_tokens=positions + 2 * 129),
                           lookup=lookup)


@torch.no_grad()
def _drafts_along(target: LoadedTarget, drafter, prompt: list[int], output: list[int], k: int) -> list[Candidates]:
    """The drafter's top-k candidates with the bonus at each output position i (0 ... n-2): what
    drafting there sees in generation -- the target's features of every token before it. One
    target pass over the whole sequence and the drafter's batched block forward; no tree is
    verified, because the target's choice at every node of the path is already known."""
    model = target.model
    seq = torch.tensor(prompt + output, device=model.device)
    n = len(seq)
    out = model(seq[None], torch.arange(n, device=model.device)[None], model.prefill_mask(n), model.new_cache(1, n),
                drafter.target_layer_ids)
    features = out.features[0]
    vocab = drafter.draft_vocab.tolist() if drafter.draft_vocab is not None else None
    drafts = []
    anchors = torch.arange(len(prompt), n - 1, device=model.device)
    for chunk in anchors.split(32):
        logprobs = torch.log_softmax(drafter.block_logits(features, seq, chunk).double(), dim=-1).cpu()
        for row in logprobs:
            c = Candidates.top_k(row, k)
            if vocab is not None:  # indices into the draft vocabulary -> token ids (both ascending)
                c = Candidates(c.logprobs, [[vocab[t] for t in ts] for ts in c.tokens])
            drafts.append(c)
    return drafts


def _rounds(drafts: list[Candidates], output: list[int], budget, lookup: SequenceLookup | None = None) -> int:
    """Rounds greedy speculation takes to emit `output` after its first token: each round grows
    the tree from the drafts at the bonus, accepts the deepest path matching the output (the
    target's own continuation) and moves past it and the new bonus -- as the engine's walk does.
    `lookup`: the sequence's lookup state over its prompt; each tree then holds its branch.

    Example, chain: output [5, 9, 2, 7, 3]; at i = 0 (bonus 5) the drafts are 9, 2, 8: the
    path 5 -> 9 -> 2 matches, 8 does not (the target says 7), so the round emits 9, 2 and the
    bonus 7, and i = 3; at i = 3 (bonus 7) the drafts are 1, ...: nothing matches, the round
    emits the bonus 3, i = 4 = the last token: 2 rounds for the 4 tokens after the first."""
    k = 1 if budget == "chain" else budget  # candidates per depth, as the engine asks for
    i, rounds, n = 0, 0, len(output)
    while i + 1 < n:
        c = drafts[i]
        branch = lookup.propose(output[: i + 1]) if lookup is not None else None
        tree = grow_tree(output[i], Candidates([lp[:k] for lp in c.logprobs], [t[:k] for t in c.tokens]),
                         len(c.tokens) if budget == "chain" else budget, branch)
        choice = torch.tensor([output[i + d + 1] if i + d + 1 < n else -1 for d in tree.depths.tolist()])
        path = walk_tree(tree, choice).path
        if lookup is not None:
            lookup.observe(tree, path)
        i += len(path)
        rounds += 1
    return rounds


def eval_drafter(target: LoadedTarget, drafter, prompts: list[str], max_tokens: int, budgets: list,
                 engine: bool = False, lookup: bool = False) -> dict:
    """Held-out tau per budget and top-1 accuracy per block position, greedy; with `lookup`,
    also tau at every tree budget with lookup branches (keys "N+lookup"; not the chain, which
    stays vanilla DFlash).

    A round's accepted length is the deepest tree path matching the target's own continuation,
    so tau follows from that continuation and the drafts along it (one plain decode per prompt,
    then no verification at all). `engine=True` instead runs every budget through the engine,
    the prompts one after another through one engine per setting (slow; it also checks the
    output is the target's) -- the two agree: see the tests."""
    requests, outputs = reference_continuations(target, prompts, max_tokens)
    if not engine:
        return drafts_report(target, drafter, requests, outputs, budgets, lookup)
    report = drafts_report(target, drafter, requests, outputs, [])
    settings = lookup_settings(budgets, lookup)
    rounds = {setting_key(b, on): 0 for b, on in settings}
    positions = max(len(r.prompt) for r in requests) + max_tokens
    for b, on in settings:
        solo = solo_engine(target.model, drafter, b, positions, lookup=on)
        for req, output in zip(requests, outputs):
            result = solo.generate([req])[0]
            assert result.tokens == output, "speculation changed a token: not lossless"
            rounds[setting_key(b, on)] += len(result.rounds)
    return report | {"tau": _tau(outputs, rounds)}


def lookup_settings(budgets: list, lookup: bool) -> list[tuple]:
    """(budget, lookup on) for every budget, then with `lookup` every tree budget again with it
    (the chain stays vanilla DFlash)."""
    return [(b, False) for b in budgets] + [(b, True) for b in budgets if lookup and b not in (0, "chain")]


def setting_key(budget, lookup: bool) -> str:
    """A report's key for a budget: "8", "chain", "8+lookup"."""
    return f"{budget}+lookup" if lookup else str(budget)


def _tau(outputs: list[list[int]], rounds: dict) -> dict:
    """Tokens emitted after each output's first (the prefill's) per round, per budget."""
    emitted = sum(len(o) - 1 for o in outputs)
    return {b: emitted / r if r else 0.0 for b, r in rounds.items()}


def drafts_report(target: LoadedTarget, drafter, requests, outputs: list[list[int]], budgets: list,
                  lookup: bool = False) -> dict:
    """tau per budget by walking the drafts along the reference `outputs`, and top-1 accuracy
    per block position over every position of them; with `lookup`, also per tree budget with
    lookup branches (one engine-wide calibration per budget, learning over the prompts in order)."""
    k = max([1] + [b for b in budgets if b != "chain"])
    hits, counts = [0] * (drafter.block_size - 1), [0] * (drafter.block_size - 1)
    settings = lookup_settings(budgets, lookup)
    rounds = {setting_key(b, on): 0 for b, on in settings}
    calibrations = {b: LookupCalibration(BATCH_DECAY) for b, on in settings if on}
    for req, output in tqdm(list(zip(requests, outputs)), desc="eval", unit="prompt"):
        drafts = _drafts_along(target, drafter, req.prompt, output, k)
        for i, c in enumerate(drafts):
            for d, ts in enumerate(c.tokens, start=1):
                if i + d < len(output):
                    hits[d - 1] += ts[0] == output[i + d]
                    counts[d - 1] += 1
        for b, on in settings:
            state = SequenceLookup(list(req.prompt), calibrations[b]) if on else None
            rounds[setting_key(b, on)] += _rounds(drafts, output, b, state)
    return {"tau": _tau(outputs, rounds), "accuracy": [h / c if c else 0.0 for h, c in zip(hits, counts)], "prompts": len(requests)}
