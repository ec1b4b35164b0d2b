"""`ddtree audit`: every output of a grid of settings against plain decoding alone, on a tiny
random pair in process; and an audit that must fail when the seeds' bug is put back."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree import audit
from ddtree.cli import main
from ddtree.kernels.tree_batch import TreeMeta, pack_bits, unpack_bits

PROMPTS = ["Count to five.", "What is two plus two?", "Name a colour.", "Say hello in French."]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def test_the_grid_holds_trees_options_only_where_a_budget_grows_trees():
    settings = audit.grid([0, "chain", 16], [1, None], [True, False], [False], [1])
    assert [s.label for s in settings] == [
        "budget 0, greedy, 1 stream", "budget chain, greedy, 1 stream",
        "budget 16, topk 1, lookup, greedy, 1 stream", "budget 16, topk 1, greedy, 1 stream",
        "budget 16, lookup, greedy, 1 stream", "budget 16, greedy, 1 stream"]


def test_first_difference_counts_an_early_end():
    assert audit.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert audit.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert audit.first_difference([1, 2, 3], [1, 2]) == 2


@pytest.mark.slow  # ~170 completions: a minute on 2 cores
def test_an_audit_of_a_tiny_pair_finds_every_output_the_targets(tiny_chat_model, prompt_file, tmp_path):
    """Budgets 0, chain, 8 and auto (topk none and 1, lookup on), greedy and seeded, 1 and 3
    streams: every completion compared, none a real divergence, exit 0, the JSON summary says so."""
    out = tmp_path / "audit.json"
    code = main(["audit", "--prompts", str(prompt_file), "--limit", "3", "--max-tokens", "8", "--budgets",
                 "0,chain,8,auto", "--topk", "none,1", "--lookup", "on", "--sampling", "greedy,seeded",
                 "--streams", "1,3", "--model", str(tiny_chat_model), "--json", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0, summary["differences"]
    settings = audit.grid([0, "chain", 8, "auto"], [None, 1], [True], [False, True], [1, 3])
    assert summary["settings"] == [s.label for s in settings]
    assert summary["compared"] == 3 * len(settings)
    assert summary["real"] == 0 and summary["identical"] + summary["near_ties"] == summary["compared"]


def test_padding_rows_visible_to_real_rows_make_the_audit_fail(tiny_chat_model, prompt_file, tmp_path, monkeypatch,
                                                              capsys):
    """The seeds' bug put back, in their configuration (budget 16, topk 1: a chain padded to 17
    rows): every row of a verify block sees the block's padding rows, as when a padded tree's
    mask was not reset. The audit must say so: exit 1, the difference listed as real with a gap
    far above the threshold, and its dump shows the diverging round -- the chain, its padding
    rows, and real rows whose mask sees them."""
    from ddtree.workers import scheduler

    real_metadata = scheduler.tree_metadata

    def leaky_metadata(batch, start):
        meta = real_metadata(batch, start)
        b, q_len = batch.parents.shape
        mask = unpack_bits(meta.bits.cpu(), q_len)
        mask |= torch.arange(q_len)[None, None, :] >= batch.sizes.cpu()[:, None, None]  # padding columns
        return TreeMeta(meta.depths, meta.positions, pack_bits(mask).to(meta.bits.device))

    monkeypatch.setattr(scheduler, "tree_metadata", leaky_metadata)
    out, dumps = tmp_path / "audit.json", tmp_path / "dump"
    code = main(["audit", "--prompts", str(prompt_file), "--limit", "2", "--max-tokens", "8", "--budgets", "16",
                 "--topk", "1", "--sampling", "greedy", "--streams", "2", "--model", str(tiny_chat_model),
                 "--json", str(out), "--dump", str(dumps)])
    summary = json.loads(out.read_text())
    assert code == 1
    assert summary["real"] >= 1
    real = [d for d in summary["differences"] if d["verdict"] == "real"]
    assert all(d["gap"] > d["threshold"] and d["setting"] == "budget 16, topk 1, greedy, 2 streams" for d in real)
    assert "real divergence" in capsys.readouterr().out
    for d in real:
        dumped = json.loads((dumps / f"prompt{d['prompt']}-budget-16--topk-1--greedy--2-streams.json").read_text())
        # (run again, the batch may diverge elsewhere: the leak reads whatever the pool held there)
        assert dumped["token"] != dumped["reference_token"]
        r = dumped["round"]
        assert r["q_len"] == 17 and r["padding_rows"] == list(range(r["real_rows"], 17))
        assert max(r["parents"][1:], default=0) < r["real_rows"]  # a chain of real nodes
        sees_padding = [i for i in range(r["real_rows"]) if any(r["mask"][i][j] for j in r["padding_rows"])]
        assert sees_padding, "the dump shows real rows seeing the padding"


def test_the_transformers_reference_is_transformers_greedy_decoding(tiny_chat_model, prompt_file, tmp_path):
    """`--reference transformers`: greedy cells are compared with Hugging Face's own model and
    `generate` over the target's checkpoint (here equal to recomputing every step with the HF
    model, no cache), seeded ones with ddtree's plain decoding (transformers cannot reproduce its
    seeded draws); the tiny pair agrees with both, and the summary names each reference."""
    from transformers import AutoModelForCausalLM

    from ddtree.config import ModelPairConfig, SamplingParams
    from ddtree.engine import Engine

    from .helpers import hf_greedy

    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4))
    reference = audit.TransformersReference(tiny_chat_model, torch.float32, engine.eos_token_ids)
    prompt = engine.render_chat([{"role": "user", "content": PROMPTS[0]}])
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert reference.tokens(engine.request(prompt, 8, SamplingParams())) == hf_greedy(hf, prompt, 8)

    out = tmp_path / "audit.json"
    code = main(["audit", "--prompts", str(prompt_file), "--limit", "2", "--max-tokens", "8", "--budgets", "0,8",
                 "--sampling", "greedy,seeded", "--streams", "1", "--reference", "transformers",
                 "--model", str(tiny_chat_model), "--json", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0, summary["differences"]
    assert summary["references"] == {"greedy": "transformers generate (greedy)", "seeded": "ddtree plain decoding"}
    assert summary["compared"] == 2 * 4 and summary["real"] == 0


def test_an_interrupted_audit_resumes_from_its_checkpoint(tiny_chat_model, tmp_path):
    """An audit of a whole prompt file takes a quarter hour a file on 2 cores, and one stopped
    near its end had to start again. With a checkpoint, an audit started again runs only the
    completions the file does not hold yet (a batch whole, its streams share the steps): cut the
    file after its fifth completion and in the middle of the sixth's line, and the rerun
    generates the rest -- no more -- and reports what the uninterrupted audit reported. A file
    written by another audit (another length) is refused, not mixed in."""
    from ddtree.config import ModelPairConfig
    from ddtree.engine import Engine

    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4, max_num_seqs=2))
    prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    settings = audit.grid([0, 8], [None], [False], [False], [1, 2])
    path = tmp_path / "audit.ckpt"
    whole = audit.run_audit(engine, prompts, settings, 6, checkpoint=path)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 3 + 3 * len(settings)  # the audit's name, 3 references, every completion
    path.write_text("\n".join(lines[:6]) + "\n" + lines[6][:10])  # 3 references and 2 completions kept

    generated = []
    real_generate = engine.generate

    def counting_generate(requests):
        generated.append(len(requests))
        return real_generate(requests)

    engine.generate = counting_generate
    resumed = audit.run_audit(engine, prompts, settings, 6, checkpoint=path)
    assert resumed.summary() == whole.summary()
    # budget 0 at 1 stream: prompt 2 alone; then the 3 other settings' 3 completions each
    # (batches of 1, 2 + 1, 1 + 1 + 1 and 2 + 1 requests)
    assert sum(generated) == 1 + 3 * 3
    assert path.read_text().splitlines() == lines  # the cut line dropped and written again, nothing twice
    with pytest.raises(ValueError, match="another audit"):
        audit.run_audit(engine, prompts, settings, 5, checkpoint=path)
