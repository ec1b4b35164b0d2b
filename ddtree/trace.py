"""Traces: what a budget policy needs to be replayed without the models (ddtree.simulate).

Every output equals the target's own decoding, so once a sequence has run, which nodes of any
tree the target accepts follows from its committed tokens: at a node whose path from the root
is the committed continuation, the target's choice is the committed next token (a seeded draw
too: it depends on the seed, the position and the target's distribution there, which is the
committed one's); no walk ever reaches a node off that path. What else a replay needs is what
the drafter would propose wherever a replayed policy drafts: its top-K candidates per depth for
the block at *every* position of the committed completion, computed once the continuation is
known (one target forward over prompt + completion for the drafter's features, then the
drafter's block forward at every anchor: ddtree.training.evaluate._drafts_along, which
training's evaluation shares). Lookup chains are not recorded: a replay's scheduler recomputes
them from the committed tokens with the real workers.lookup.SequenceLookup.

A trace file (np.savez_compressed):

    meta            JSON string: Trace.meta (model, drafter, prompt files, max tokens, K, the
                    recording run's measured costs, ...)
    prompts         [sum P_s] int32, all prompts concatenated; prompt_offsets [S + 1] int64
    completions     [sum N_s] int32, all completions concatenated; completion_offsets [S + 1]
    cand_tokens     [sum (N_s - 1), D, K] int32: sequence s's candidates for the block whose
                    bonus is completion token i (0 <= i < N_s - 1), at rows completion_offsets[s]
                    - s + i; depth d's K best tokens, descending by log-prob
    cand_logprobs   [sum (N_s - 1), D, K] float32: their log-probs
    requests        JSON string: per sequence its max_tokens, eos ids, sampling fields, finish reason
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import SamplingParams
from .kernels.tree import Candidates
from .workers.requests import Request

TRACE_FORMAT = "ddtree-trace-v1"


@dataclass
class TraceSequence:
    """One recorded request and its committed completion, with the drafter's candidates at
    every completion position but the last."""

    prompt: list[int]  # [P] prompt token ids
    completion: list[int]  # [N] committed completion token ids (an EOS that ended it included)
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    sampling: SamplingParams
    finish_reason: str
    cand_tokens: np.ndarray  # [N - 1, D, K] int32: the candidates with completion[i] as the bonus
    cand_logprobs: np.ndarray  # [N - 1, D, K] float32

    def request(self, budget=None, lookup: bool | None = None) -> Request:
        """The request that committed this completion (at any budget it commits the same)."""
        return Request(list(self.prompt), self.max_tokens, (), tuple(self.eos_token_ids), self.sampling, budget, lookup)

    def candidates(self, index: int, depths: int, top_k: int) -> Candidates:
        """The drafter's candidates with completion[index] as the bonus, cut to `depths` depths
        and `top_k` per depth (what workers.batch_backends.BatchDrafter.propose returns)."""
        return Candidates(self.cand_logprobs[index, :depths, :top_k].astype(np.float64).tolist(),
                          self.cand_tokens[index, :depths, :top_k].tolist())


@dataclass
class Trace:
    sequences: list[TraceSequence]
    meta: dict = field(default_factory=dict)  # how it was recorded: model, drafter, files, costs, ...

    @property
    def block_size(self) -> int:
        return int(self.meta["block_size"])

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    def save(self, path: str | Path) -> None:
        seqs = self.sequences
        offsets = lambda parts: np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)  # noqa: E731
        requests = [{"max_tokens": s.max_tokens, "eos_token_ids": list(s.eos_token_ids),
                     "sampling": s.sampling.model_dump(), "finish_reason": s.finish_reason} for s in seqs]
        d, k = self.block_size - 1, self.top_k
        np.savez_compressed(
            path,
            meta=np.array(json.dumps({"format": TRACE_FORMAT, **self.meta})),
            requests=np.array(json.dumps(requests)),
            prompts=np.concatenate([np.asarray(s.prompt, np.int32) for s in seqs]),
            prompt_offsets=offsets([s.prompt for s in seqs]),
            completions=np.concatenate([np.asarray(s.completion, np.int32) for s in seqs]),
            completion_offsets=offsets([s.completion for s in seqs]),
            cand_tokens=np.concatenate([s.cand_tokens.reshape(-1, d, k) for s in seqs]).astype(np.int32),
            cand_logprobs=np.concatenate([s.cand_logprobs.reshape(-1, d, k) for s in seqs]).astype(np.float32),
        )

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        with np.load(path) as f:
            meta = json.loads(str(f["meta"]))
            if meta.get("format") != TRACE_FORMAT:
                raise ValueError(f"{path}: not a {TRACE_FORMAT} file (format {meta.get('format')!r})")
            requests = json.loads(str(f["requests"]))
            po, co = f["prompt_offsets"], f["completion_offsets"]
            prompts, completions = f["prompts"], f["completions"]
            tokens, logprobs = f["cand_tokens"], f["cand_logprobs"]
        seqs, at = [], 0
        for s, req in enumerate(requests):
            completion = completions[co[s]:co[s + 1]].tolist()
            rows = max(len(completion) - 1, 0)
            seqs.append(TraceSequence(prompts[po[s]:po[s + 1]].tolist(), completion, req["max_tokens"],
                                      tuple(req["eos_token_ids"]), SamplingParams(**req["sampling"]),
                                      req["finish_reason"], tokens[at:at + rows], logprobs[at:at + rows]))
            at += rows
        return cls(seqs, meta)


def candidates_along(model, drafter, prompt: list[int], completion: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's (a DFlashDrafter's) top-k candidates per depth for the block at every
    completion position but the last, given the target model's features of the committed
    tokens -> tokens [N - 1, D, k] int32, log-probs [N - 1, D, k] float32."""
    from .training.evaluate import _drafts_along
    from .workers.loading import LoadedTarget

    drafts = _drafts_along(LoadedTarget(model, None, None), drafter, prompt, completion, k)
    d = drafter.block_size - 1
    if not drafts:
        return np.zeros((0, d, k), np.int32), np.zeros((0, d, k), np.float32)
    return (np.asarray([c.tokens for c in drafts], np.int32).reshape(-1, d, k),
            np.asarray([c.logprobs for c in drafts], np.float32).reshape(-1, d, k))


def trace_of(model, drafter, requests: list[Request], completions: list[list[int]], top_k: int,
             finish: list[str] | None = None, progress=None) -> Trace:
    """The trace of `requests` whose committed completions are `completions` (their finish
    reasons, else "stop" where the last token is an EOS): the drafter's candidates along each.
    `progress(done, total)` after each sequence."""
    seqs = []
    for i, (request, completion) in enumerate(zip(requests, completions)):
        tokens, logprobs = candidates_along(model, drafter, request.prompt, completion, top_k)
        reason = finish[i] if finish else ("stop" if completion[-1] in request.eos_token_ids else "length")
        seqs.append(TraceSequence(list(request.prompt), list(completion), request.max_tokens,
                                  tuple(request.eos_token_ids), request.sampling, reason, tokens, logprobs))
        if progress:
            progress(i + 1, len(requests))
    return Trace(seqs, {"block_size": drafter.block_size, "top_k": top_k})


def measured_costs(policy) -> dict:
    """What the recording engine's policy measured: T(r) ("step_seconds", calibrate's format, as
    the live steps left it) and its fits of the drafter's pass, D = d0 + d1 k + c R ("draft_fit":
    [d0, d1, c]), and of the rest of a step, O = o0 + o1 B + o2 N ("rest_fit")."""
    return {"step_seconds": {str(r): s for r, s in policy.verify.points.items()},
            "draft_fit": list(policy.draft.w), "rest_fit": list(policy.rest.w)}


def record(engine, texts: list[str], max_tokens: int, top_k: int, sampling: SamplingParams = SamplingParams(),
           budget="auto", progress=None, completions: list[list[int]] | None = None,
           on_completions=None) -> Trace:
    """A trace of `texts` (user messages) on the engine's pair: the completions (run through the
    engine's step loop at `budget`, all at once up to its max_num_seqs -- any budget commits the
    same tokens; unless given, e.g. from an interrupted recording) and the drafter's candidates
    along each. `on_completions(completions)` once they are known; `progress(done, total)` after
    each sequence's candidates."""
    prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in texts]
    requests = [engine.request(p, max_tokens, sampling, budget=budget) for p in prompts]
    finish = None
    if completions is None:
        results = engine.generate(requests)
        completions, finish = [r.tokens for r in results], [r.finish_reason for r in results]
        if on_completions:
            on_completions(completions)
    recorded = trace_of(engine.target.model, engine.scheduler.drafter.proposer, requests, completions, top_k,
                        finish, progress)
    recorded.meta.update(max_tokens=max_tokens, budget=str(budget), torch_threads=torch.get_num_threads(),
                         recorded_costs=measured_costs(engine.scheduler.policy))
    return recorded
