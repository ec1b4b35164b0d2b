"""`ddtree audit`: does this deployment's output equal the target's own decoding, and where not,
was it a numerical near-tie or a real divergence?

For every prompt and every setting of a grid (budget, topk, lookup branches, greedy or seeded
sampling, streams batched together), the engine's output is compared with the same target's plain
decoding of the same request alone (budget 0, one stream). A difference is reported at its first
position with both tokens and how close the target was to choosing otherwise there:

- greedy: the reference's top-2 logit gap after the common prefix;
- seeded (T > 0): how far the seeded draw for that position lies from the nearest edge between
  two tokens in the processed distribution's CDF.

Below the dtype's threshold (`TIE_THRESHOLDS`) it is a near-tie -- where ddtree's bitwise CPU
kernels do not run (their fallback, other dtypes, CUDA), a tree-verify pass and a one-token step
sum in different orders, so logits differ in the last bits, and where that flips a token it is
not a bug (docs/cpu-kernels.md, "Numerics") -- else it is a real divergence, and the audit fails.

What is audited: the engine in process, or (`ServedOutputs`, `--url`) a running server through
the official openai client, each setting's streams sent as concurrent requests that return their
token ids. What it is compared with: the target's plain decoding by ddtree (`PlainReference`),
or for greedy cells (`TransformersReference`, `--reference transformers`) Hugging Face
transformers' own model and `generate` over the target's checkpoint, an implementation that
shares no code with ddtree's; seeded cells keep ddtree's plain decoding as their reference, as
transformers cannot reproduce ddtree's seeded draws (a counter-based RNG keyed by seed and
position).

    ddtree audit --prompts benchmarks/data/gsm8k-test.jsonl --limit 20 \\
        --budgets 0,chain,16,64,auto --sampling greedy,seeded --streams 1,8 --json audit.json
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from .config import SamplingParams
from .kernels.sampling import processed_probs, uniform
from .workers.requests import Budget, Request

# A difference whose gap is below the threshold of the target's dtype is a near-tie:
# (greedy: top-2 logit gap, seeded: distance of the draw to the nearest CDF edge)
TIE_THRESHOLDS = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-3, 1e-6),
    torch.bfloat16: (0.125, 1e-2),
    torch.float16: (0.0625, 1e-3),
}
SEEDED = SamplingParams(temperature=0.8, top_p=0.95)  # the audit's T > 0 sampling; each prompt its own seed
SEED_BASE = 1000  # prompt i's seed: SEED_BASE + i


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """The target's logits for the token after `ids`, from one plain forward over them."""
    n = len(ids)
    out = model(torch.tensor([ids], device=model.device), torch.arange(n, device=model.device)[None],
                model.prefill_mask(n), model.new_cache(1, n), logits_to_keep=1)
    return out.logits[0, -1].float().cpu() if out.logits.dtype == torch.bfloat16 else out.logits[0, -1].cpu()


def tie_gap(model, request: Request, seed: int | None, context: list[int]) -> float:
    """How close the target was to choosing differently after prompt + `context`: the top-2 logit
    gap (greedy), or the distance of the seeded draw to the nearest CDF edge (sampled)."""
    logits = next_token_logits(model, request.prompt + context)
    if seed is None:
        top = logits.topk(2).values
        return float(top[0] - top[1])
    cdf = processed_probs(logits[None], request.sampling)[0].cumsum(-1)
    u = uniform(seed, len(request.prompt) + len(context)) * float(cdf[-1])
    return float((cdf - u).abs().min())


def tie_threshold(dtype: torch.dtype, seeded: bool) -> float:
    greedy, sampled = TIE_THRESHOLDS.get(dtype, TIE_THRESHOLDS[torch.float32])
    return sampled if seeded else greedy


def first_difference(reference: list[int], got: list[int]) -> int | None:
    """The first position where two completions differ (one ending before the other counts), or None."""
    at = next((j for j, (a, b) in enumerate(zip(reference, got)) if a != b), None)
    if at is None and len(reference) != len(got):
        at = min(len(reference), len(got))
    return at


class PlainReference:
    """The target's plain decoding by ddtree: budget 0, the request alone; gaps from its logits."""

    name = "ddtree plain decoding"

    def __init__(self, engine):
        self.engine = engine
        self.dtype = engine.target.model.dtype

    def tokens(self, request: Request) -> list[int]:
        return self.engine.generate([replace(request, budget=0)])[0].tokens

    def gap(self, request: Request, seed: int | None, context: list[int]) -> float:
        return tie_gap(self.engine.target.model, request, seed, context)


class TransformersReference:
    """Greedy decoding by Hugging Face transformers: its own model class over the target's
    checkpoint and its `generate` (no sampling, the target's EOS), in the target's dtype; gaps
    from its logits. Greedy requests only: a seeded one is ddtree's own draws."""

    name = "transformers generate (greedy)"

    def __init__(self, directory, dtype: torch.dtype, eos_token_ids: tuple[int, ...]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=dtype).eval()
        self.dtype, self.eos = dtype, list(eos_token_ids)

    @torch.no_grad()
    def tokens(self, request: Request) -> list[int]:
        from transformers import GenerationConfig

        assert request.sampling.temperature == 0, "greedy requests only: transformers cannot draw ddtree's seeded tokens"
        ids = torch.tensor([request.prompt])
        config = GenerationConfig(max_new_tokens=request.max_tokens, do_sample=False, eos_token_id=self.eos or None,
                                  pad_token_id=(self.eos or [0])[0])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, len(request.prompt):].tolist()

    @torch.no_grad()
    def gap(self, request: Request, seed: int | None, context: list[int]) -> float:
        top = self.model(torch.tensor([request.prompt + context])).logits[0, -1].float().topk(2).values
        return float(top[0] - top[1])


class ServedOutputs:
    """The audited outputs of a running ddtree server (`ddtree audit --url`): each prompt as one
    user message through the official openai client, a setting's streams as concurrent requests,
    non-streamed with `return_token_ids`. The server must render the prompt to the same tokens as
    the engine in process (the same target and chat template), or the audit stops."""

    def __init__(self, url: str, texts: list[str], prompts: list[list[int]], max_tokens: int,
                 model: str | None = None, api_key: str | None = None):
        from openai import OpenAI

        self.base, self.api_key = url.rstrip("/") + "/v1", api_key or "none"
        self.texts, self.prompts, self.max_tokens = texts, prompts, max_tokens
        self.model = model or OpenAI(base_url=self.base, api_key=self.api_key, max_retries=0).models.list().data[0].id

    def __call__(self, setting: "Setting", batch: list[int]) -> list[list[int]]:
        return asyncio.run(self._batch(setting, batch))

    async def _batch(self, setting: "Setting", batch: list[int]) -> list[list[int]]:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=self.base, api_key=self.api_key, max_retries=0, timeout=600) as client:
            return list(await asyncio.gather(*(self._one(client, setting, i) for i in batch)))

    async def _one(self, client, setting: "Setting", i: int) -> list[int]:
        sampling = sampling_for(setting.seeded, i)
        speculation = {"budget": setting.budget, "lookup": setting.lookup}
        if setting.topk is not None:
            speculation["topk"] = setting.topk
        reply = await client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": self.texts[i]}], max_tokens=self.max_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
            extra_body={"speculation": speculation, "return_token_ids": True})
        if reply.model_extra.get("prompt_token_ids") != self.prompts[i]:
            raise ValueError(f"the server rendered prompt {i} to other tokens than the engine here: it serves "
                             "another target or chat template (give this command the server's --model)")
        return reply.choices[0].model_extra["token_ids"]


def divergence(model, request: Request, seed: int | None, reference: list[int], got: list[int]):
    """None if the token lists are equal; else (index, gap, is_near_tie) of the first difference."""
    at = first_difference(reference, got)
    if at is None:
        return None
    gap = tie_gap(model, request, seed, reference[:at])
    return at, gap, gap < tie_threshold(model.dtype, seed is not None)


@dataclass(frozen=True)
class Setting:
    """One cell of the audit's grid."""

    budget: Budget
    topk: int | None = None
    lookup: bool = False
    seeded: bool = False  # T > 0 with a seed per prompt (SEEDED), else greedy
    streams: int = 1  # requests batched together in one scheduler

    @property
    def label(self) -> str:
        parts = [f"budget {self.budget}"]
        if self.topk is not None:
            parts.append(f"topk {self.topk}")
        if self.lookup:
            parts.append("lookup")
        parts += ["seeded" if self.seeded else "greedy", f"{self.streams} stream{'s' if self.streams > 1 else ''}"]
        return ", ".join(parts)


@dataclass
class Difference:
    prompt: int  # index in the prompt file
    setting: str
    position: int  # first differing completion position
    reference_token: int | None  # plain decoding's token there (None: it had ended)
    token: int | None  # the audited run's token there (None: it had ended)
    gap: float  # top-2 logit gap (greedy) or the draw's distance to a CDF edge (seeded)
    threshold: float
    verdict: str  # "near-tie" or "real"


@dataclass
class AuditReport:
    settings: list[str]
    prompts: int
    max_tokens: int
    dtype: str
    references: dict[str, str] = field(default_factory=dict)  # "greedy" / "seeded" -> what outputs are compared with
    audited: str = "the engine in process"  # or the server's URL
    compared: int = 0  # completions compared
    identical: int = 0
    differences: list[Difference] = field(default_factory=list)

    @property
    def real(self) -> list[Difference]:
        return [d for d in self.differences if d.verdict == "real"]

    def summary(self) -> dict:
        return {"prompts": self.prompts, "max_tokens": self.max_tokens, "dtype": self.dtype,
                "audited": self.audited, "references": self.references,
                "settings": self.settings, "compared": self.compared, "identical": self.identical,
                "near_ties": len(self.differences) - len(self.real), "real": len(self.real),
                "differences": [asdict(d) for d in self.differences]}


def grid(budgets: Iterable[Budget], topks: Iterable[int | None], lookups: Iterable[bool], seeded: Iterable[bool],
         streams: Iterable[int]) -> list[Setting]:
    """Every combination; lookup and topk only where a budget grows trees (not 0, not the chain)."""
    settings = []
    for b, k, lk, s, n in itertools.product(budgets, topks, lookups, seeded, streams):
        trees = b not in (0, "chain")
        setting = Setting(b, k if trees else None, lk and trees, s, n)
        if setting not in settings:
            settings.append(setting)
    return settings


def sampling_for(seeded: bool, prompt_index: int) -> SamplingParams:
    return SEEDED.model_copy(update={"seed": SEED_BASE + prompt_index}) if seeded else SamplingParams()


def generate_recorded(engine, requests: list[Request]) -> tuple[list, list[list]]:
    """The requests as one batch on the engine's scheduler, recording every verify pass: (results,
    per request its rounds' workers.scheduler.VerifyRecord in order)."""
    scheduler = engine.scheduler
    records: dict[int, list] = {}  # id(request) -> its rounds
    scheduler.on_verify = lambda rows: [records.setdefault(id(r.request), []).append(r) for r in rows]
    try:
        results = scheduler.generate(requests)
    finally:
        scheduler.on_verify = None
    return results, [records.get(id(r), []) for r in requests]


def diverging_round(rounds: list, position: int):
    """The recorded round that emitted completion position `position` (None: the prefill's)."""
    for r in rounds:
        if r.emitted <= position < r.emitted + len(r.path):
            return r
    return None


def round_json(r) -> dict:
    """A verify row as JSON: the tree, its padding, mask, positions and accepted path."""
    tree = r.tree
    return {"emitted_before": r.emitted, "q_len": r.q_len, "real_rows": tree.size,
            "padding_rows": list(range(tree.size, r.q_len)),
            "tokens": tree.tokens.tolist(), "parents": tree.parents.tolist(), "depths": tree.depths.tolist(),
            "scores": tree.scores.tolist() if tree.scores is not None else None,
            "sources": tree.sources.tolist() if tree.sources is not None else None,
            "positions": r.positions, "mask": [[int(v) for v in row] for row in r.mask],
            "accepted_path": r.path, "bonus": r.bonus}


class Checkpoint:
    """The completions an audit has run so far, so that an interrupted audit resumes where it
    stopped. With a path they live in a JSON-lines file: a first line naming the audit (its
    prompts, length, dtype, what is audited and against what), then a line per completion as it
    is compared. A file naming another audit is refused rather than mixed in; a last line cut short
    by the interruption is dropped from it."""

    def __init__(self, path: Path | None, identity: dict):
        self.path = Path(path) if path is not None else None
        self.done: dict[str, list[int]] = {}
        if self.path is None:
            return
        text = self.path.read_text() if self.path.exists() else ""
        lines = text.splitlines()
        if not lines:
            self.path.write_text(json.dumps(identity) + "\n")
            return
        if json.loads(lines[0]) != identity:
            raise ValueError(f"{self.path} holds the completions of another audit ({lines[0]}); "
                             f"remove it or name another --checkpoint")
        kept = lines[:1]
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break
            self.done[entry["key"]] = entry["tokens"]
            kept.append(line)
        if len(kept) < len(lines) or not text.endswith("\n"):
            self.path.write_text("\n".join(kept) + "\n")  # what follows appends whole lines

    def get(self, key: str) -> list[int] | None:
        return self.done.get(key)

    def put(self, key: str, tokens: list[int]) -> None:
        self.done[key] = tokens
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"key": key, "tokens": tokens}) + "\n")


def run_audit(engine, prompts: list[list[int]], settings: list[Setting], max_tokens: int,
              progress: Callable[[], None] = lambda: None, dump_dir: Path | None = None,
              served: ServedOutputs | None = None, greedy_reference: TransformersReference | None = None,
              checkpoint: Path | None = None) -> AuditReport:
    """Runs every setting over every prompt on `engine` (in process), or on `served` (a running
    server), and compares each output with the same request's plain decoding alone by `engine`
    (PlainReference), or for greedy cells by `greedy_reference`. `progress` is called once per
    completion run. With `dump_dir` (in process only), a batch that diverged runs again recording
    its verify passes, and each difference's round (tree, padding, mask, positions, accepted path)
    is written there as JSON. With `checkpoint` (a file), every completion is kept there as it is
    compared, and the completions it already holds are not run again (Checkpoint)."""
    if served is not None and dump_dir is not None:
        raise ValueError("a dump records the engine's rounds in process; a server's cannot be recorded")
    plain = PlainReference(engine)
    chosen = {False: greedy_reference or plain, True: plain}
    report = AuditReport([s.label for s in settings], len(prompts), max_tokens,
                         str(plain.dtype).removeprefix("torch."),
                         {("seeded" if k else "greedy"): r.name for k, r in chosen.items()
                          if k in {s.seeded for s in settings}},
                         "the engine in process" if served is None else served.base)

    def request(i: int, seeded: bool, budget: Budget = 0, topk: int | None = None, lookup: bool = False) -> Request:
        return engine.request(prompts[i], max_tokens, sampling_for(seeded, i), budget=budget, lookup=lookup, topk=topk)

    def audited(setting: Setting, batch: list[int]) -> list[list[int]]:
        if served is not None:
            return served(setting, batch)
        return [r.tokens for r in engine.generate(
            [request(i, setting.seeded, setting.budget, setting.topk, setting.lookup) for i in batch])]

    store = Checkpoint(checkpoint, {"prompts": prompts, "max_tokens": max_tokens, "dtype": report.dtype,
                                    "audited": report.audited, "references": report.references,
                                    "pair": engine.config.model_dump(mode="json", include={"model", "drafter", "weights"})})
    references: dict[tuple[int, bool], list[int]] = {}
    for seeded in sorted({s.seeded for s in settings}):
        for i in range(len(prompts)):  # plain decoding, one request alone
            key = f"reference, {'seeded' if seeded else 'greedy'}, prompt {i}"
            if store.get(key) is None:
                store.put(key, chosen[seeded].tokens(request(i, seeded)))
            references[i, seeded] = store.get(key)
            progress()
    for setting in settings:
        for start in range(0, len(prompts), setting.streams):
            batch = list(range(start, min(start + setting.streams, len(prompts))))
            keys = [f"{setting.label}, prompt {i}" for i in batch]
            if any(store.get(k) is None for k in keys):  # a batch runs whole: its streams share the steps
                for k, tokens in zip(keys, audited(setting, batch)):
                    store.put(k, tokens)
            for i, tokens in zip(batch, [store.get(k) for k in keys]):
                progress()
                report.compared += 1
                reference = references[i, setting.seeded]
                at = first_difference(reference, tokens)
                if at is None:
                    report.identical += 1
                    continue
                req = request(i, setting.seeded)
                seed = req.sampling.seed if setting.seeded else None
                gap = chosen[setting.seeded].gap(req, seed, reference[:at])
                threshold = tie_threshold(plain.dtype, setting.seeded)
                report.differences.append(Difference(
                    i, setting.label, at, reference[at] if at < len(reference) else None,
                    tokens[at] if at < len(tokens) else None, gap, threshold,
                    "near-tie" if gap < threshold else "real"))
            if dump_dir is not None and any(d.setting == setting.label and d.prompt in batch
                                            for d in report.differences):
                dump(engine, [request(i, setting.seeded, setting.budget, setting.topk, setting.lookup) for i in batch],
                     batch, references, setting, Path(dump_dir))
    return report


def dump(engine, requests: list[Request], batch: list[int], references: dict, setting: Setting, dump_dir: Path) -> None:
    """Runs a diverging batch again, recording its verify passes, and writes each request's first
    difference with the round that emitted it: dump_dir/prompt<i>-<setting>.json."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    results, rounds = generate_recorded(engine, requests)
    for i, result, recorded in zip(batch, results, rounds):
        reference = references[i, setting.seeded]
        at = first_difference(reference, result.tokens)
        if at is None:
            continue
        diverged = diverging_round(recorded, at)
        slug = "".join(c if c.isalnum() else "-" for c in setting.label).strip("-")
        (dump_dir / f"prompt{i}-{slug}.json").write_text(json.dumps({
            "prompt": i, "setting": setting.label, "position": at,
            "reference_token": reference[at] if at < len(reference) else None,
            "token": result.tokens[at] if at < len(result.tokens) else None,
            "round": None if diverged is None else round_json(diverged)}, indent=1))


def markdown(report: AuditReport) -> str:
    """One row per setting (compared, identical, near-ties, real), then every difference."""
    lines = ["| setting | compared | identical | near-ties | real |", "| --- | --- | --- | --- | --- |"]
    per_setting = report.compared // max(len(report.settings), 1)
    for label in report.settings:
        diffs = [d for d in report.differences if d.setting == label]
        real = sum(d.verdict == "real" for d in diffs)
        lines.append(f"| {label} | {per_setting} | {per_setting - len(diffs)} | {len(diffs) - real} | {real} |")
    if report.differences:
        lines += ["", "| prompt | setting | position | plain | audited | gap | threshold | verdict |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for d in report.differences:
            lines.append(f"| {d.prompt} | {d.setting} | {d.position} | {d.reference_token} | {d.token} | "
                         f"{d.gap:.3g} | {d.threshold:.0e} | {d.verdict} |")
    return "\n".join(lines)


def write_json(report: AuditReport, path) -> None:
    with open(path, "w") as f:
        json.dump(report.summary(), f, indent=2)
