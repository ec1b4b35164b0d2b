"""`ddtree bench`: ddtree at every budget against transformers, side by side in one run.

For each prompt, every setting runs once, in an order that rotates from prompt to prompt, after
one warm-up pass of every setting: plain decoding (ddtree budget 0), the DFlash chain, DDTree at
each budget (with `lookup`, each tree budget also with lookup branches in its trees),
transformers `generate()` greedy and transformers prompt-lookup assisted generation, all greedy
on the same model and prompts. Machines here are shared and noisy, so
the figures that matter are the ratios within one run.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .config import SamplingParams
from .engine import Engine
from .kernels.tree import Tree, build_tree, verify_block
from .workers.requests import PHASES as ROUND_PHASES

PROMPT_LOOKUP_TOKENS = 10
# The round phases (workers.requests.PHASES; the step loop's verify time includes any transport)
# and "other": prefill and the rest of the decode time.
TIMED = tuple(p for p in ROUND_PHASES if p != "transport")
PHASES = (*TIMED, "other")


def read_prompts(path: str | Path, limit: int | None) -> list[str]:
    """JSONL rows with `question`, `turns[0]` or `prompt`."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        text = row.get("question") or (row.get("turns") or [None])[0] or row.get("prompt")
        if not text:
            raise ValueError(f"{path}: a row has no question, turns[0] or prompt: {line[:80]}")
        prompts.append(text)
        if limit and len(prompts) >= limit:
            break
    return prompts


MIXED_FILES = ("gsm8k-test.jsonl", "humaneval.jsonl", "vicuna-bench.jsonl")  # benchmarks/data: the mixed workload


def interleaved_prompts(paths: list[str | Path], per_file: int) -> list[str]:
    """The first `per_file` prompts of each file, interleaved (a, b, c, a, b, c, ...): with
    MIXED_FILES, the mixed workload the budget policy is measured and soaked on."""
    sets = [read_prompts(path, per_file) for path in paths]
    return [p for group in zip(*sets) for p in group]


def write_prompts(path: str | Path, prompts: list[str]) -> None:
    """`prompts` as JSONL rows with `prompt` (what read_prompts reads back)."""
    with open(path, "w") as f:
        for text in prompts:
            f.write(json.dumps({"prompt": text}) + "\n")


@dataclass
class Row:
    mode: str  # "ddtree", "ddtree-lookup" (lookup branches in the trees), "hf-generate", "hf-prompt-lookup"
    budget: int | str | None  # ddtree's budget (0, "chain", N); None for the peers
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    round_tokens: int = 0  # output tokens of the rounds (all but each request's first)
    phase_s: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    tau: float | None = None
    tokens_per_s: float = 0.0
    speedup_vs_ar: float = 0.0
    speedup_vs_hf: float = 0.0
    verify_rows: int | None = None  # Q: the rows of this setting's verify pass (its tree, bucketed)
    verify_cost_ratio: float | None = None  # T(Q) / T(1) of the target
    outputs: list = field(default_factory=list)  # [prompts] the token ids each prompt generated

    @property
    def label(self) -> str:
        if not self.is_ddtree:
            return self.mode
        return f"ddtree budget {self.budget}" + (" + lookup" if self.mode == "ddtree-lookup" else "")

    @property
    def is_ddtree(self) -> bool:
        return self.mode in ("ddtree", "ddtree-lookup")


def verify_costs(engine: Engine, sizes: list[int], context: int = 300, repeats: int = 7) -> dict[int, float]:
    """Median seconds of one target pass over q tree tokens after a `context`-token cache."""
    model = engine.target.model
    if model is None:
        raise ValueError("bench times the target's forward in this process: run it at tp 1")
    cache = model.new_cache(1, context + max(sizes) + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(context)[None], model.prefill_mask(context), cache)
    cache.lengths += context
    g = torch.Generator().manual_seed(1)
    out = {}
    for q in sizes:
        logprobs = torch.log_softmax(torch.randn(8, model.config.vocab_size, generator=g, dtype=torch.float64), -1)
        tree = build_tree(0, logprobs, q - 1) if q > 1 else Tree.root_only(0)
        block = verify_block(tree, context, pad_to=q)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(block.tokens[None], block.positions[None], block.mask[None], cache)
            times.append(time.perf_counter() - start)
        out[q] = statistics.median(times[2:] if repeats > 3 else times)
    return out


class HFPeer:
    """transformers' own generation on the same checkpoint (the reference, in its eager fp32)."""

    def __init__(self, engine: Engine):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(engine.target.directory, dtype=engine.target.model.dtype).eval()
        self.eos = engine.eos_token_ids

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, prompt_lookup: bool) -> list[int]:
        ids = torch.tensor([prompt])
        kwargs = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS} if prompt_lookup else {}
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=list(self.eos) or None, pad_token_id=self.eos[0] if self.eos else 0, **kwargs,
        )
        return out[0, ids.shape[1]:].tolist()


def run_bench(
    engine: Engine,
    prompts: list[str],
    budgets: list,
    max_tokens: int,
    peers: bool = True,
    progress=None,
    lookup: bool = False,
) -> list[Row]:
    settings: list[tuple[str, object]] = [("ddtree", b) for b in budgets]
    if lookup:  # every tree budget again with lookup branches (not 0 or the chain: they have none)
        settings += [("ddtree-lookup", b) for b in budgets if b not in (0, "chain")]
    hf = HFPeer(engine) if peers else None
    if hf:
        settings += [("hf-generate", None), ("hf-prompt-lookup", None)]
    rows = {s: Row(mode=s[0], budget=s[1]) for s in settings}
    greedy = SamplingParams()
    encoded = [engine.render_chat([{"role": "user", "content": p}]) for p in prompts]

    def once(setting, prompt, tokens, row: Row | None):
        mode, budget = setting
        start = time.perf_counter()
        if mode in ("ddtree", "ddtree-lookup"):
            request = engine.request(prompt, tokens, greedy, budget=budget, lookup=mode == "ddtree-lookup")
            result = engine.generate([request])[0]
            output = result.tokens
        else:
            result, output = None, hf.generate(prompt, tokens, prompt_lookup=mode == "hf-prompt-lookup")
        seconds = time.perf_counter() - start
        if row is None:
            return
        n = len(output)
        row.outputs.append(list(output))
        row.tokens += n
        row.seconds += seconds
        if result is not None:
            # tau counts the round outputs only: the prefill's first token is not a round's
            row.rounds += len(result.rounds)
            row.phase_s["other"] += result.prefill_s
            for r in result.rounds:
                for phase in TIMED:
                    row.phase_s[phase] += getattr(r, f"{phase}_s")
            row.phase_s["other"] += result.decode_s - sum(
                getattr(r, f"{p}_s") for r in result.rounds for p in TIMED
            )
            row.round_tokens += n - 1

    for setting in settings:  # warm-up
        once(setting, encoded[0], min(8, max_tokens), None)
    for i, prompt in enumerate(encoded):
        order = settings[i % len(settings):] + settings[: i % len(settings)]
        for setting in order:
            once(setting, prompt, max_tokens, rows[setting])
        if progress:
            progress(i + 1, len(encoded))

    sizes = sorted({1} | {engine.verify_len(b) for b in budgets if b not in (0, "auto")})
    costs = verify_costs(engine, sizes)
    out = list(rows.values())
    for row in out:
        row.tokens_per_s = row.tokens / row.seconds if row.seconds else 0.0
        if row.is_ddtree:
            row.tau = row.round_tokens / row.rounds if row.rounds else 0.0
            row.verify_rows = engine.verify_len(row.budget)  # None for auto: the policy's Q varies
            if row.verify_rows is not None:
                row.verify_cost_ratio = costs[row.verify_rows] / costs[1]
    ar = next(r for r in out if r.mode == "ddtree" and r.budget == 0).tokens_per_s if 0 in budgets else None
    hf_rate = next((r.tokens_per_s for r in out if r.mode == "hf-generate"), None)
    for row in out:
        row.speedup_vs_ar = row.tokens_per_s / ar if ar else 0.0
        row.speedup_vs_hf = row.tokens_per_s / hf_rate if hf_rate else 0.0
    return out


def markdown(rows: list[Row]) -> str:
    lines = [
        "| setting | tau | tokens/s | vs budget 0 | vs HF generate | Q | T(Q)/T(1) | draft / tree / verify / commit / other (% of time) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        total = sum(r.phase_s.values())
        split = " / ".join(f"{100 * r.phase_s[p] / total:.0f}" for p in PHASES) if r.is_ddtree and total else "-"
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        cost = f"{r.verify_cost_ratio:.2f}" if r.verify_cost_ratio is not None else "-"
        rows_q = r.verify_rows if r.verify_rows is not None else "-"
        lines.append(
            f"| {r.label} | {tau} | {r.tokens_per_s:.2f} | {r.speedup_vs_ar:.2f}x | {r.speedup_vs_hf:.2f}x | {rows_q} | {cost} | {split} |"
        )
    return "\n".join(lines)


def json_rows(rows: list[Row]) -> list[dict]:
    out = []
    for r in rows:
        d = asdict(r)
        d.pop("phase_s")
        d["phase_seconds"] = r.phase_s
        out.append(d)
    return out


def plot(rows: list[Row], path: str | Path, title: str) -> None:
    """tau and speed-up over budget 0 against the budget (the chain drawn at B-1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = [r for r in rows if r.mode == "ddtree" and isinstance(r.budget, int)]
    with_lookup = [r for r in rows if r.mode == "ddtree-lookup" and isinstance(r.budget, int)]
    chain = [r for r in rows if r.mode == "ddtree" and r.budget == "chain"]
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    budgets = [r.budget for r in tree]
    ax_tau.plot(budgets, [r.tau for r in tree], "o-", label="DDTree")
    ax_speed.plot(budgets, [r.speedup_vs_ar for r in tree], "o-", label="DDTree")
    if with_lookup:
        ax_tau.plot([r.budget for r in with_lookup], [r.tau for r in with_lookup], "s-", label="DDTree + lookup")
        ax_speed.plot([r.budget for r in with_lookup], [r.speedup_vs_ar for r in with_lookup], "s-",
                      label="DDTree + lookup")
    for r in chain:
        ax_tau.axhline(r.tau, ls="--", color="gray", label="chain (DFlash)")
        ax_speed.axhline(r.speedup_vs_ar, ls="--", color="gray", label="chain (DFlash)")
    for r in rows:
        if not r.is_ddtree:
            ax_speed.axhline(r.speedup_vs_ar, ls=":", label=r.mode, color="tab:red" if r.mode == "hf-generate" else "tab:green")
    ax_speed.axhline(1.0, color="black", lw=0.8)
    ax_tau.set(xlabel="tree budget (drafted nodes)", ylabel="tau (tokens per round)", title="acceptance")
    ax_speed.set(xlabel="tree budget (drafted nodes)", ylabel="tokens/s vs ddtree budget 0", title="speed-up")
    save_figure(fig, (ax_tau, ax_speed), title, path)


def save_figure(fig, axes, title: str, path) -> None:
    """Grid and legend on every panel, the title, then the PNG at `path` (shared by the plots)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
