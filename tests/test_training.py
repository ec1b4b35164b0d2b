"""`ddtree train-drafter` end to end on a tiny random target: data, train (and resume), export,
then the exported drafter loads, drafts and is evaluated losslessly."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch

from ddtree.training.data import load_sequences, plan_prompts, stage_data
from ddtree.training.evaluate import _rounds, eval_drafter, solo_engine
from ddtree.training.export import stage_export
from ddtree.training.train import (
    MIN_LR_RATE,
    TrainConfig,
    block_loss,
    init_drafter,
    lr_schedule,
    position_weights,
    sample_anchors,
    stage_train,
)
from ddtree.training.teacher import load_teacher, sequence_teacher, stage_teacher
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target
from ddtree.workers.requests import Request
from ddtree.workers.scheduler import BatchLimits, Scheduler

LAYERS = (0,)  # the tiny target has 2 layers; the last one cannot be captured (see stage_data)


@pytest.fixture(scope="module")
def trained(tiny_chat_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("train-drafter")
    prompts = work / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"What is {i} plus {i + 3}?"}) for i in range(6)))
    target = load_target(tiny_chat_model, torch.float32)
    stage_data(target, work, [str(prompts)], 6, 2, LAYERS, max_tokens=24, batch=4, seed=0)
    cfg = TrainConfig(block_size=4, num_layers=1, steps=40, sequences_per_step=2, anchors_per_sequence=8,
                      warmup=5, lr=3e-3, checkpoint_every=20, snapshot_every=20, held_out=0.15, mask_token_id=16,
                      vocab_floor=256)
    before = init_drafter(target, cfg, LAYERS)
    state = stage_train(target, work, cfg, LAYERS)
    return target, work, cfg, before, state


def fixed_batch_loss(drafter, sequences, cfg):
    rng = random.Random(5)
    weights = position_weights(cfg.block_size, cfg.gamma)
    losses = []
    with torch.no_grad():
        for tokens, features, start in sequences:
            anchors = sample_anchors(len(tokens), start, cfg.block_size, 8, rng)
            if anchors:
                losses.append(float(block_loss(drafter, tokens, features.float(), torch.tensor(anchors), weights)[0]))
    return sum(losses) / len(losses)


def test_data_stage_captures_features_for_every_token(trained):
    target, work, *_ = trained
    sequences = load_sequences(work)
    assert len(sequences) == 8  # 6 file prompts + 2 the target wrote
    for tokens, features, start in sequences:
        assert features.shape == (len(tokens), len(LAYERS) * target.model.config.hidden_size)
        assert 0 < start < len(tokens)


def test_data_features_are_the_targets_own(trained):
    """Features captured during batched generation equal our model's layer outputs on the
    same tokens (fp16 storage, left padding in the batch)."""
    target, work, *_ = trained
    tokens, features, _ = load_sequences(work)[0]
    n = len(tokens)
    out = target.model(tokens[None], torch.arange(n)[None], target.model.prefill_mask(n), target.model.new_cache(1, n), capture_layers=LAYERS)
    torch.testing.assert_close(features.float(), out.features[0], rtol=2e-2, atol=2e-2)


def test_training_lowers_the_loss_and_resumes(trained):
    target, work, cfg, before, state = trained
    assert state.step == 40
    sequences = load_sequences(work)
    saved = torch.load(work / "train" / "checkpoint.pt", weights_only=False)
    after = init_drafter(target, cfg, LAYERS, saved["drafter"])
    before.set_draft_vocab(after.draft_vocab)  # the same head for both losses
    assert fixed_batch_loss(after, sequences, cfg) < 0.8 * fixed_batch_loss(before, sequences, cfg)
    assert state.held_out == max(1, int(len(sequences) * cfg.held_out)) == 1
    seen = torch.cat([t for t, _, _ in sequences[state.held_out :]]).unique()
    assert set(after.draft_vocab.tolist()) == set(seen.tolist()) | set(range(cfg.vocab_floor)), \
        "draft vocabulary = the training tokens + the ids below the floor"
    assert after.config.draft_vocab_size < target.model.config.vocab_size
    longer = TrainConfig(**{**cfg.__dict__, "steps": 45})
    resumed = stage_train(target, work, longer, LAYERS)
    assert resumed.step == 45 and resumed.history[0][0] == 20, "resumed from the step-40 checkpoint"
    assert sorted(f.name for f in (work / "train" / "snapshots").iterdir()) == ["step-000020", "step-000040"]


def test_export_loads_drafts_and_evaluates(trained, tmp_path):
    target, work, cfg, *_ = trained
    out = stage_export(target, work, cfg, LAYERS, tmp_path / "export", data_note="test prompts")
    assert (out / "README.md").read_text().startswith("# DFlash drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == list(LAYERS) and config["block_size"] == 4
    drafter = DFlashDrafter.load(out, target.model)
    assert config["dflash_config"]["draft_vocab_size"] == len(drafter.draft_vocab) < config["vocab_size"]
    report = eval_drafter(target, drafter, ["What is 2 plus 5?", "Hello"], 12, ["chain", 4])
    assert set(report["tau"]) == {"chain", "4"}  # its values: test_offline_tau_equals_the_engines
    assert len(report["accuracy"]) == 3


def test_export_can_cut_the_draft_vocabulary_to_the_most_used_ids(trained, tmp_path):
    """`--vocab-keep N`: the head covers only the N draft-vocabulary ids the training responses
    use most (counted here independently, held-out sequences excluded; ties at the cut go to
    the lower id), so a draft costs less. Nothing but the head's rows changes: the cut drafter's
    logits are the full one's at the kept ids; and the engine drafting with it equals plain
    decoding."""
    from collections import Counter

    target, work, cfg, *_ = trained
    full = DFlashDrafter.load(stage_export(target, work, cfg, LAYERS, tmp_path / "full"), target.model)
    sequences = load_sequences(work)
    held = torch.load(work / "train" / "checkpoint.pt", weights_only=False)["state"]["held_out"]
    counts = Counter(t for tokens, _, start in sequences[held:] for t in tokens[start:].tolist())
    ranked = sorted(full.draft_vocab.tolist(), key=lambda t: (-counts[t], t))
    keep = 12  # ties at the cut go to the lower id
    out = stage_export(target, work, cfg, LAYERS, tmp_path / "cut", vocab_keep=keep)
    cut = DFlashDrafter.load(out, target.model)
    assert cut.draft_vocab.tolist() == sorted(ranked[:keep])
    assert json.loads((out / "config.json").read_text())["dflash_config"]["draft_vocab_size"] == keep
    assert f"draft vocabulary {keep} of" in (out / "README.md").read_text()
    tokens, features, begin = sequences[0]
    anchors = torch.arange(begin, len(tokens) - cfg.block_size)
    kept = torch.searchsorted(full.draft_vocab, cut.draft_vocab)  # the kept ids' places in the full head
    with torch.no_grad():
        torch.testing.assert_close(cut.float().block_logits(features.float(), tokens, anchors),
                                   full.float().block_logits(features.float(), tokens, anchors)[..., kept],
                                   rtol=1e-5, atol=1e-5)
    tok = target.tokenizer
    requests = lambda: [Request(tok.encode(p), 16) for p in ("What is 2 plus 5?", "Hello there")]  # noqa: E731
    plain = solo_engine(target.model, None, 0, 64).generate(requests())
    drafted = solo_engine(target.model, cut, 4, 64).generate(requests())
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]


def test_a_later_training_run_continues_a_saved_drafter(trained, tmp_path):
    """The machine that trained a drafter may not keep its data: a later training run generates new
    data and continues the saved drafter (--init-from) instead of starting again from the
    target's last layers. Step 0 of that run is the saved drafter itself (its bf16 weights),
    its draft vocabulary is widened by the new run's tokens and floor, never narrowed, and the
    model card says what it continued. A drafter of another shape is refused."""
    import shutil

    target, work, cfg, *_ = trained
    saved_dir = tmp_path / "saved"
    saved = DFlashDrafter.load(stage_export(target, work, cfg, LAYERS, tmp_path / "exported"), target.model)
    # two ids the new data does not hold and the new floor does not reach: they must stay
    kept = [target.model.config.vocab_size - 2, target.model.config.vocab_size - 1]
    saved.set_draft_vocab(torch.cat([saved.draft_vocab, torch.tensor(kept)]))
    saved.save(saved_dir)
    later = tmp_path / "later"
    shutil.copytree(work / "data", later / "data")
    wider = TrainConfig(**{**cfg.__dict__, "steps": 0, "vocab_floor": 300})
    state = stage_train(target, later, wider, LAYERS, init_from=saved_dir)
    assert state.init_from == str(saved_dir)
    start = init_drafter(target, wider, LAYERS, torch.load(later / "train" / "checkpoint.pt", weights_only=False)["drafter"])
    for name, tensor in saved.state_dict().items():
        if name != "draft_vocab":
            assert torch.equal(start.state_dict()[name], tensor.float()), name
    assert set(kept) <= set(saved.draft_vocab.tolist())
    assert set(start.draft_vocab.tolist()) == set(saved.draft_vocab.tolist()) | set(range(300))
    card = (stage_export(target, later, wider, LAYERS, tmp_path / "next") / "README.md").read_text()
    assert f"continued from the drafter saved at {saved_dir}" in card
    other = TrainConfig(**{**cfg.__dict__, "block_size": 5})
    shutil.copytree(work / "data", tmp_path / "other" / "data")
    with pytest.raises(ValueError, match="differ"):
        stage_train(target, tmp_path / "other", other, LAYERS, init_from=saved_dir)


def test_the_teacher_is_the_targets_own_next_token_distribution(trained, tmp_path):
    """Soft labels (teacher.py): row t of a sequence's teacher is the target's top-K over token
    t given the tokens before it, for every response token (the prompt's rows are zeros). The
    data stage decoded greedily, so the teacher's first choice is the token the data holds
    (batched decoding, fp16 features and one prefill differ only in rounding: a mismatch is
    allowed only at a near-tie, whose gap is shown); the log-probs are sorted, their mass at most
    1; rows line up with load_sequences'. Resumed from the captured features of layer 0, it
    equals the whole target's prefill up to the features' fp16 rounding."""
    import shutil

    target, work, *_ = trained
    shutil.copytree(work / "data", tmp_path / "data")
    stage_teacher(target, tmp_path, LAYERS, top_k=8)
    sequences, teachers = load_sequences(tmp_path), load_teacher(tmp_path)
    assert len(teachers) == len(sequences)
    for (tokens, _, start), (ids, logprobs) in zip(sequences, teachers):
        assert ids.shape == logprobs.shape == (len(tokens), 8)
        assert not ids[:start].any() and not logprobs[:start].any(), "the prompt's rows are never labels"
        lp = logprobs[start:].float()
        assert (lp[:, :-1] >= lp[:, 1:]).all() and (lp.exp().sum(-1) <= 1.001).all()
        for t in range(start, len(tokens)):
            if ids[t, 0] != tokens[t]:
                gap = float(logprobs[t, 0] - logprobs[t, 1])
                assert gap < 1e-2 and tokens[t] in ids[t, :2], f"position {t}: not the greedy token, gap {gap}"
        whole = sequence_teacher(target, tokens, 8, start)
        torch.testing.assert_close(whole[1].float(), logprobs.float(), atol=2e-2, rtol=0)
        assert (whole[0][:, 0] == ids[:, 0]).float().mean() > 0.95


def test_soft_labels_that_are_the_hard_ones_give_the_hard_loss(trained):
    """distill mixes the hard cross-entropy with the cross-entropy against the teacher: a teacher
    sure of the greedy token (log-prob 0 there) is the hard label, so any share gives the hard
    loss; a real teacher's soft labels give another loss, with a gradient everywhere; share 0
    ignores the teacher."""
    target, work, cfg, *_ = trained
    drafter = init_drafter(target, cfg, LAYERS)
    tokens, features, start = load_sequences(work)[1]
    anchors = torch.tensor(sample_anchors(len(tokens), start, cfg.block_size, 8, random.Random(0)))
    weights = position_weights(cfg.block_size, cfg.gamma)
    hard = block_loss(drafter, tokens, features.float(), anchors, weights)[0]
    k = 4
    sure = (torch.cat([tokens[:, None], torch.zeros(len(tokens), k - 1, dtype=torch.long)], 1).int(),
            torch.cat([torch.zeros(len(tokens), 1), torch.full((len(tokens), k - 1), -60.0)], 1).half())
    for share in (0.3, 1.0):
        torch.testing.assert_close(block_loss(drafter, tokens, features.float(), anchors, weights, sure, share)[0], hard)
    teacher = sequence_teacher(target, tokens, k)
    assert torch.equal(block_loss(drafter, tokens, features.float(), anchors, weights, teacher, 0.0)[0], hard)
    soft = block_loss(drafter, tokens, features.float(), anchors, weights, teacher, 1.0)[0]
    assert abs(float((soft - hard).detach())) > 1e-3
    soft.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.parameters() if p.requires_grad)


def test_training_with_soft_labels_computes_the_teacher_once_and_learns(trained, tmp_path):
    """--distill: the train stage writes the teacher files it lacks (once: a resumed run reuses
    them), the loss falls as with hard labels, and the model card says which loss trained it."""
    import shutil

    target, work, cfg, before, _ = trained
    shutil.copytree(work / "data", tmp_path / "data")
    soft = TrainConfig(**{**cfg.__dict__, "steps": 30, "distill": 0.5})
    stage_train(target, tmp_path, soft, LAYERS)
    written = sorted((tmp_path / "data").glob("teacher-*.safetensors"))
    assert len(written) == len(list((tmp_path / "data").glob("shard-*.safetensors"))) > 0
    stamps = [p.stat().st_mtime_ns for p in written]
    stage_train(target, tmp_path, TrainConfig(**{**soft.__dict__, "steps": 35}), LAYERS)
    assert [p.stat().st_mtime_ns for p in written] == stamps, "the teacher is not computed again"
    sequences = load_sequences(tmp_path)
    after = init_drafter(target, cfg, LAYERS, torch.load(tmp_path / "train" / "checkpoint.pt", weights_only=False)["drafter"])
    start = init_drafter(target, cfg, LAYERS)
    start.set_draft_vocab(after.draft_vocab)
    assert fixed_batch_loss(after, sequences, cfg) < 0.8 * fixed_batch_loss(start, sequences, cfg)
    card = (stage_export(target, tmp_path, soft, LAYERS, tmp_path / "export") / "README.md").read_text()
    assert "0.5 x the cross-entropy against its own top-32 distribution" in card, "the model card names the loss"


def test_training_reaches_every_parameter_of_the_drafter(trained):
    """Bug: the MLP's gate and up projections run as one fused GEMM (FusedLinears) whose matrix
    is a plain tensor, so under autograd no gradient reached them: three training runs of the
    shipped drafter trained with every gate/up projection frozen at its start (the third layer's at its
    random initialization). Every trainable parameter must get a gradient from the block loss."""
    target, work, cfg, *_ = trained
    drafter = init_drafter(target, cfg, LAYERS)
    tokens, features, start = load_sequences(work)[0]
    anchors = torch.tensor(sample_anchors(len(tokens), start, cfg.block_size, 8, random.Random(0)))
    block_loss(drafter, tokens, features.float(), anchors, position_weights(cfg.block_size, cfg.gamma))[0].backward()
    trainable = {name: p for name, p in drafter.named_parameters() if p.requires_grad}
    assert any("gate_proj" in name for name in trainable) and any("q_proj" in name for name in trainable)
    missing = [name for name, p in trainable.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_a_later_training_run_may_add_layers_on_top(trained, tmp_path):
    """A drafter may grow between training runs (`--layers 2 --init-from` a 1-layer drafter): the
    added layer starts as an identity (its output projections zero), so step 0 drafts exactly
    as the saved drafter; training then moves the new layer. A run may not drop layers."""
    import shutil

    target, work, cfg, *_ = trained
    saved_dir = stage_export(target, work, cfg, LAYERS, tmp_path / "one")
    saved = DFlashDrafter.load(saved_dir, target.model).float()
    later = tmp_path / "later"
    shutil.copytree(work / "data", later / "data")
    two = TrainConfig(**{**cfg.__dict__, "steps": 0, "num_layers": 2})
    stage_train(target, later, two, LAYERS, init_from=saved_dir)
    start = init_drafter(target, two, LAYERS, torch.load(later / "train" / "checkpoint.pt", weights_only=False)["drafter"])
    assert len(start.layers) == 2 and len(saved.layers) == 1
    tokens, features, begin = load_sequences(later)[0]
    anchors = torch.arange(begin, len(tokens) - cfg.block_size)
    with torch.no_grad():
        assert torch.equal(start.block_logits(features.float(), tokens, anchors),
                           saved.block_logits(features.float(), tokens, anchors))
    trained_on = TrainConfig(**{**two.__dict__, "steps": 5})
    stage_train(target, later, trained_on, LAYERS)
    grown = init_drafter(target, trained_on, LAYERS,
                         torch.load(later / "train" / "checkpoint.pt", weights_only=False)["drafter"])
    assert grown.layers[1].self_attn.o_proj.weight.abs().sum() > 0
    two_dir = stage_export(target, later, trained_on, LAYERS, tmp_path / "two")
    shutil.copytree(work / "data", tmp_path / "fewer" / "data")
    with pytest.raises(ValueError, match="add layers to a saved drafter, not drop them"):
        stage_train(target, tmp_path / "fewer", cfg, LAYERS, init_from=two_dir)


def test_offline_tau_equals_the_engines(trained, tiny_chat_model, tmp_path):
    """eval-drafter computes tau from the target's greedy continuation and the drafts along it,
    without verifying trees; running every budget through the engine must count the same
    rounds -- with lookup branches too, whose calibration learns over the prompts in order. float64, so that features from one prefill pass and from the engine's tree passes
    pick the same drafts."""
    target, work, cfg, *_ = trained
    out = stage_export(target, work, cfg, LAYERS, tmp_path / "export")
    target64 = load_target(tiny_chat_model, torch.float64)
    drafter = DFlashDrafter.load(out, target64.model)
    prompts = ["What is 4 plus 7?", "What is 1 plus 4?", "Write a poem"]
    budgets = ["chain", 3, 8]
    offline = eval_drafter(target64, drafter, prompts, 40, budgets, lookup=True)
    engine = eval_drafter(target64, drafter, prompts, 40, budgets, engine=True, lookup=True)
    assert offline == engine, (offline["tau"], engine["tau"])
    assert set(offline["tau"]) == {"chain", "3", "8", "3+lookup", "8+lookup"}
    assert max(offline["tau"].values()) > 1.0, "some drafts accepted, so the walk is exercised"
    assert offline["tau"]["8+lookup"] != offline["tau"]["8"], "lookup branches changed some rounds"


def test_the_last_layer_cannot_be_captured(tiny_chat_model, tmp_path):
    """Regression: transformers hands back the last layer's output after the final norm, so
    features of that layer captured during generation would not be what drafting reads."""
    target = load_target(tiny_chat_model, torch.float32)
    with pytest.raises(ValueError, match="last"):
        stage_data(target, tmp_path, [], 0, 0, (0, 1), max_tokens=4, batch=2, seed=0)


def test_rounds_walk_the_trees_along_the_output():
    """The accepted path of a round is the deepest tree path matching the output; a budget that
    reaches one node deeper saves a round. Output [5, 9, 2, 7, 3]; drafts at the bonus 5 rank 4
    over 9 at depth 1, then 2 and 7 below: the best-first tree holds 5 -> 9 -> 2 -> 7 only from
    budget 6 on ((4), (4,2), (4,2,7), (9), (9,2), (9,2,7))."""
    from ddtree.kernels.tree import Candidates

    at_5 = Candidates([[-0.5, -0.9], [-0.1, -2.0], [-0.1, -3.0]], [[4, 9], [2, 6], [7, 1]])
    miss = Candidates([[-0.1, -0.2]] * 3, [[0, 1]] * 3)
    drafts = [at_5, miss, miss, miss]
    output = [5, 9, 2, 7, 3]
    assert _rounds(drafts, output, 6) == 1  # 9, 2, 7 accepted + bonus 3
    assert _rounds(drafts, output, 5) == 2  # 9, 2 + bonus 7; then the bonus 3 alone
    assert _rounds(drafts, output, "chain") == 4  # the chain 4, 2, 7 misses at once, every round


def test_a_grown_data_plan_keeps_its_shards_and_appends_the_new_prompts(tmp_path):
    """Rerunning the data stage with a larger --limit-per-file must not reshuffle the prompts of
    shards already generated (they are on disk, with their features): only new shards follow."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"q{i}"}) for i in range(7)))
    plan = tmp_path / "prompts.json"
    first = plan_prompts(None, plan, [str(prompts)], 3, 0, batch=2, seed=0)
    assert sorted(e["prompt"] for shard in first for e in shard) == ["q0", "q1", "q2"] and len(first) == 2
    grown = plan_prompts(None, plan, [str(prompts)], 6, 0, batch=2, seed=0)
    assert grown[:2] == first
    assert sorted(e["prompt"] for shard in grown[2:] for e in shard) == ["q3", "q4", "q5"]
    assert plan_prompts(None, plan, [str(prompts)], 6, 0, batch=2, seed=0) == grown, "a rerun changes nothing"
    assert {e["domain"] for shard in grown for e in shard} == {"prompts"}  # a file's prompts: its name
    assert json.loads(plan.read_text())["mix"] == {"prompts": 6}


def test_a_later_training_run_takes_the_prompts_an_earlier_one_did_not(tmp_path):
    """--skip-per-file: a training run whose machine lost the earlier data plans the file's next
    prompts, not the ones already trained on."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"q{i}"}) for i in range(7)))
    plan = plan_prompts(None, tmp_path / "prompts.json", [str(prompts)], 3, 0, batch=2, seed=0, skip_per_file=3)
    assert sorted(e["prompt"] for shard in plan for e in shard) == ["q3", "q4", "q5"]


def test_no_prompt_of_the_judged_sets_is_ever_planned(tmp_path):
    """The held-out rule: a training file that contains prompts of the judged evaluation sets
    (benchmarks/data: gsm8k-test, humaneval, vicuna-bench -- every turn) has them left out of
    the plan, whatever their whitespace; the default held-out files are those sets."""
    from ddtree.training.data import DEFAULT_HELD_OUT, held_out_texts

    assert all(path.is_file() for path in DEFAULT_HELD_OUT) and len(DEFAULT_HELD_OUT) == 3
    rows = [json.loads(line) for f in DEFAULT_HELD_OUT for line in f.read_text().splitlines()[:3]]
    judged = [r.get("question") or r.get("prompt") or r["turns"][-1] for r in rows]
    assert len(held_out_texts(DEFAULT_HELD_OUT)) == 1319 + 164 + 80  # every row of the three sets
    mixed = tmp_path / "train.jsonl"
    mixed.write_text("\n".join(json.dumps({"question": q}) for q in
                               ["fine 1", judged[0], "fine 2", "  " + judged[4].replace(" ", "  "), judged[8], "fine 3"]))
    plan = plan_prompts(None, tmp_path / "prompts.json", [str(mixed)], 100, 0, batch=4, seed=0)
    assert sorted(e["prompt"] for shard in plan for e in shard) == ["fine 1", "fine 2", "fine 3"]


def test_learning_rate_warms_up_then_decays_to_a_tenth_and_resumes_where_it_stopped():
    """lr_schedule: linear warmup from 0 to cfg.lr over cfg.warmup steps, then cosine decay to
    cfg.lr * MIN_LR_RATE at cfg.steps. A scheduler rebuilt over a fresh optimizer and loaded from a
    checkpoint's state dicts (as stage_train resumes) continues the uninterrupted run's rates."""
    cfg = TrainConfig(steps=20, warmup=4, lr=1e-3)

    def fresh():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        return opt, lr_schedule(opt, cfg)

    def rates(opt, sched, steps):
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    whole = rates(*fresh(), cfg.steps + 1)
    assert whole[:5] == pytest.approx([0, cfg.lr / 4, cfg.lr / 2, 3 * cfg.lr / 4, cfg.lr])
    assert whole[12] == pytest.approx(cfg.lr * (MIN_LR_RATE + (1 - MIN_LR_RATE) / 2)), "cosine: half way at mid-decay"
    assert whole[cfg.steps] == pytest.approx(cfg.lr * MIN_LR_RATE)
    assert all(a > b for a, b in zip(whole[4:], whole[5:])), "decays after the warmup"

    opt, sched = fresh()
    first = rates(opt, sched, 9)
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    opt, sched = fresh()
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    assert first + rates(opt, sched, cfg.steps + 1 - 9) == pytest.approx(whole)


def test_a_recording_scheduler_decodes_plainly_and_says_so(tiny_checkpoint):
    """The data stage's scheduler records features of plain decoding only: a tree's rows would
    record features of tokens that are never committed. A request with a tree is refused."""
    _, target, _ = tiny_checkpoint("llama", 97)
    drafter = DFlashDrafter.untrained(target, block_size=4, seed=1)
    scheduler = Scheduler.local(target, drafter, 0, BatchLimits(max_num_seqs=2), record_features=(0,))
    with pytest.raises(ValueError, match="budget 0"):
        scheduler.add(Request([1, 2, 3], 4, budget=8))
    (result,) = scheduler.generate([Request([1, 2, 3], 5)])
    assert result.features.shape == (3 + 5 - 1, target.config.hidden_size)
