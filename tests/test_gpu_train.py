"""benchmarks/gpu_train.py: a drafter's training run on a lent GPU, in one device call. GPUs come
rarely and for minutes, so everything it does is run here first, on the CPU and a tiny target:
the whole run end to end without Ray or the web stack (the GPU image has neither), its
clocks, the shards it brings back, and training under bf16 autocast as it runs there."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.training.data import load_sequences, stage_data, stage_features
from ddtree.training.train import FIT_PROBE_STEPS, TrainConfig, init_drafter, stage_train
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target, safetensors_files

from .test_gpu_check import BLOCKER
from .test_training import LAYERS, fixed_batch_loss

ROOT = Path(__file__).resolve().parents[1]


def test_a_whole_training_run_runs_without_ray_and_brings_back_small_shards_that_load(tiny_chat_model, tmp_path):
    """The script's every stage on a tiny target, with Ray and the web stack unimportable: the
    drafter comes back sharded under the size limit (here 8 KiB a shard, to force several) and
    loads; training goes on past its timed probe; the tokens file holds every data sequence, and
    their features made again from it are the recorded ones; report.json says what ran."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"What is {i} times {i + 2}?"}) for i in range(5)))
    earlier, earlier_tokens = random_tokens_file(tmp_path / "earlier.safetensors")
    out = tmp_path / "out"
    code = ("import sys, runpy; sys.argv = sys.argv[1:]; import gpu_train; gpu_train.SHARD_BYTES = 8 * 1024; gpu_train.FIT_PROBE_STEPS = 4; "
            "gpu_train.main()")
    args = ["gpu_train.py", "--out", str(out), "--workdir", str(tmp_path / "work"), "--model", str(tiny_chat_model),
            "--device", "cpu", "--prompts", str(prompts), "--self-prompts", "2", "--max-tokens", "16", "--batch", "4",
            "--init-from", "none", "--layers", "1", "--target-layers", *map(str, LAYERS), "--block-size", "4",
            "--steps", "12", "--sequences-per-step", "2", "--anchors", "4", "--vocab-floor", "256",
            "--eval-prompts", "2", "--eval-tokens", "8", "--tokens", str(earlier)]
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT / 'benchmarks'}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["sequences"] == 7 and report["data"]["shards_left"] == 0  # 5 file prompts + 2 self-written
    assert report["train"]["steps"] == 12  # 4 probed, then a schedule fitted to the clock, capped by --steps
    assert set(report["tau16"]) == {"gsm8k-test", "humaneval", "vicuna-bench"}
    assert all(set(row) == {"new"} and row["new"]["tau"] >= 1.0 for row in report["tau16"].values())
    shards = safetensors_files(out / "drafter")
    assert len(shards) >= 2 and all(p.stat().st_size <= 8 * 1024 + 2048 for p in shards)
    target = load_target(tiny_chat_model, torch.float32)
    drafter = DFlashDrafter.load(out / "drafter", target.model)
    assert drafter.config.num_hidden_layers == 1 and drafter.draft_vocab is not None
    tokens = load_file(str(out / "tokens.safetensors"))
    trained_on = load_sequences(tmp_path / "work")
    sequences, carried = trained_on[:7], trained_on[7:]  # this run's shards sort before the carried ones
    assert report["carried_sequences"] == 3 and [t.tolist() for t, _, _ in carried] == earlier_tokens
    assert tokens["tokens"].dtype == torch.uint16  # SmolLM2's ids fit: 2 bytes a token
    assert tokens["offsets"][-1] == len(tokens["tokens"]) == sum(len(t) for t, _, _ in sequences)
    assert tokens["response_starts"].tolist() == [s for _, _, s in sequences]
    assert len(tokens["domains"]) == 7 and report["data"]["by_domain"] == {"prompts": 5, "code": 1, "chat": 1}
    # a later training run makes the features again from the token ids alone: the recorded ones
    again = tmp_path / "again"
    assert stage_features(target, again, out / "tokens.safetensors", LAYERS, per_shard=3) == 7
    assert len(list((again / "data").glob("shard-*"))) == 3
    for (t1, f1, s1), (t2, f2, s2) in zip(sequences, load_sequences(again), strict=True):
        assert torch.equal(t1, t2) and s1 == s2
        torch.testing.assert_close(f2.float(), f1.float(), rtol=2e-2, atol=2e-2)


def random_tokens_file(path: Path) -> tuple[Path, list[list[int]]]:
    """A tokens file of three random sequences (response starts 5, 4, 6), as export_tokens writes one."""
    rng = torch.Generator().manual_seed(3)
    lengths, starts = [12, 9, 15], [5, 4, 6]
    tokens = torch.randint(100, 5000, (sum(lengths),), generator=rng).to(torch.uint16)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    save_file({"tokens": tokens, "offsets": offsets, "response_starts": torch.tensor(starts),
               "domains": torch.zeros(3, dtype=torch.int64)}, str(path), metadata={"domains": '["earlier"]'})
    return path, [tokens[a:b].tolist() for a, b in zip(offsets, offsets[1:])]


def test_the_data_stage_stops_at_its_deadline_and_a_rerun_makes_the_rest(tiny_chat_model, tmp_path):
    """A run's data stage is cut by the device call's clock: it must leave finished shards
    alone, say how many are left, and make exactly those when run again."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"Name {i} colours."}) for i in range(4)))
    target = load_target(tiny_chat_model, torch.float32)
    args = (target, tmp_path, [str(prompts)], 4, 0, LAYERS)
    left = stage_data(*args, max_tokens=8, batch=2, seed=0, deadline=time.time() - 1)
    assert left == 2 and not list((tmp_path / "data").glob("shard-*"))
    assert stage_data(*args, max_tokens=8, batch=2, seed=0) == 0
    assert len(load_sequences(tmp_path)) == 4


def test_training_under_bf16_autocast_learns(tiny_chat_model, tmp_path):
    """On a GPU the drafter trains under bf16 autocast (TrainConfig.autocast picks it there);
    the same path on the CPU: the loss falls as it does in fp32 (test_training)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"What is {i} plus {i + 3}?"}) for i in range(6)))
    target = load_target(tiny_chat_model, torch.float32)
    stage_data(target, tmp_path, [str(prompts)], 6, 0, LAYERS, max_tokens=24, batch=3, seed=0)
    cfg = TrainConfig(block_size=4, num_layers=1, steps=40, sequences_per_step=2, anchors_per_sequence=8, warmup=5,
                      lr=3e-3, checkpoint_every=40, snapshot_every=0, held_out=0.15, mask_token_id=16, vocab_floor=256,
                      autocast="bfloat16")
    before = init_drafter(target, cfg, LAYERS)
    state = stage_train(target, tmp_path, cfg, LAYERS)
    saved = torch.load(tmp_path / "train" / "checkpoint.pt", weights_only=False)
    after = init_drafter(target, cfg, LAYERS, saved["drafter"])
    before.set_draft_vocab(after.draft_vocab)
    sequences = load_sequences(tmp_path)
    assert state.step == 40 and torch.isfinite(torch.tensor(state.loss_ema))
    assert fixed_batch_loss(after, sequences, cfg) < 0.8 * fixed_batch_loss(before, sequences, cfg)


def test_the_cli_makes_a_runs_data_from_a_tokens_file_and_stops_data_at_its_clock(tiny_chat_model, tmp_path,
                                                                                       capsys):
    """`train-drafter --stage data --from-tokens FILE` (a GPU run's tokens, trained on
    anywhere) writes shards whose sequences are the file's, and `--stage tokens` turns them back
    into the same file; `--data-minutes` reaches the data stage (a clock already run out:
    nothing made, and it says what is left)."""
    from ddtree.cli import main

    path, expected = random_tokens_file(tmp_path / "t.st")
    common = ["train-drafter", "--stage", "data", "--model", str(tiny_chat_model), "--target-layers", "0",
              "--device", "cpu"]
    assert main([*common, "--workdir", str(tmp_path / "a"), "--from-tokens", str(path)]) == 0
    got = load_sequences(tmp_path / "a")
    assert [t.tolist() for t, _, _ in got] == expected
    assert [s for _, _, s in got] == [5, 4, 6] and all(f.shape == (len(t), 32) for t, f, _ in got)
    assert main(["train-drafter", "--stage", "tokens", "--workdir", str(tmp_path / "a"), "--model",
                 str(tiny_chat_model), "--out", str(tmp_path / "back.st")]) == 0  # and back to token ids
    back, source = load_file(str(tmp_path / "back.st")), load_file(str(path))
    assert all(torch.equal(back[k], source[k]) for k in ("tokens", "offsets", "response_starts"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "Why?"}) + "\n")
    assert main([*common, "--workdir", str(tmp_path / "b"), "--prompts", str(prompts), "--self-prompts", "0",
                 "--max-tokens", "4", "--data-minutes", "-1"]) == 0
    assert "data: 1 shards left (time limit)" in capsys.readouterr().out
    assert not list((tmp_path / "b" / "data").glob("shard-*"))


@pytest.mark.smollm2
def test_the_kept_training_tokens_hold_no_judged_prompt(smollm2):
    """Drafter data kept in the repository (benchmarks/data/drafter-tokens) is trained on by
    later training runs anywhere: none of its prompts may be one of the judged sets' (whitespace
    aside). Every sequence's prompt part is decoded and searched for every judged prompt."""
    from safetensors import safe_open

    from ddtree.training.data import DEFAULT_HELD_OUT, _normal, held_out_texts

    files = sorted((ROOT / "benchmarks" / "data" / "drafter-tokens").glob("*.safetensors"))
    assert files, "no kept training tokens"
    judged = held_out_texts(DEFAULT_HELD_OUT)
    assert len(judged) > 1000
    for path in files:
        data = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            domains = json.loads(f.metadata()["domains"])
        offsets, starts = data["offsets"].tolist(), data["response_starts"].tolist()
        assert len(offsets) == len(starts) + 1 == len(data["domains"]) + 1 and offsets[-1] == len(data["tokens"])
        assert all(0 < s < b - a for s, a, b in zip(starts, offsets, offsets[1:]))
        assert set(domains) <= {"gsm8k-train", "code", "chat", "math",  # the data stage's own prompts
                                "stdlib-code", "gsm8k-variants", "chat-open"}  # benchmarks/{stdlib_prompts,gsm8k_variants,chat_prompts}.py
        prompts = smollm2.tokenizer.batch_decode([data["tokens"][a:a + s].tolist() for a, s in zip(offsets, starts)])
        for prompt in prompts:
            text = _normal(prompt)
            assert not any(q in text for q in judged), f"{path.name}: a judged prompt in {prompt[:200]!r}"


def test_a_clocked_run_fits_its_schedule_to_the_clock_from_its_first_steps(tiny_chat_model, tmp_path):
    """`fit_after`: a run of 10,000 steps given a 3-second clock times its first 2 steps and
    shortens its cosine to what the clock leaves room for (a GPU run's training ends with its
    learning rate decayed, not cut off at the peak); the checkpoint keeps the fitted length."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"Count to {i}."}) for i in range(4)))
    target = load_target(tiny_chat_model, torch.float32)
    stage_data(target, tmp_path, [str(prompts)], 4, 0, LAYERS, max_tokens=16, batch=4, seed=0)
    cfg = TrainConfig(block_size=4, num_layers=1, steps=10_000, sequences_per_step=2, anchors_per_sequence=4, warmup=1,
                      checkpoint_every=10_000, snapshot_every=0, held_out=0.25, mask_token_id=16, vocab_floor=256)
    state = stage_train(target, tmp_path, cfg, LAYERS, deadline=time.time() + 3, fit_after=2)
    assert 2 <= cfg.steps < 10_000 and state.step <= cfg.steps
    saved = torch.load(tmp_path / "train" / "checkpoint.pt", weights_only=False)
    assert saved["config"]["steps"] == cfg.steps and saved["state"]["step"] == state.step


def test_the_cli_fits_its_schedule_to_minutes_only_when_asked(tiny_chat_model, tmp_path, capsys):
    """`train-drafter --stage train --minutes M --fit-schedule` (a CPU training run on a clock) ends
    its cosine with the clock: the checkpoint's schedule is shorter than --steps. Without the
    flag the clock cuts the schedule off where it stands (the learning rate still high), as
    training runs before it did."""
    from ddtree.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"Count to {i}."}) for i in range(4)))
    target = load_target(tiny_chat_model, torch.float32)
    common = ["train-drafter", "--stage", "train", "--model", str(tiny_chat_model), "--device", "cpu",
              "--target-layers", *map(str, LAYERS), "--layers", "1", "--block-size", "4", "--steps", "100000",
              "--sequences-per-step", "2", "--anchors", "4", "--vocab-floor", "256", "--mask-token-id", "16",
              "--minutes", "0.1"]
    for name, flags in (("fitted", ["--fit-schedule"]), ("cut", [])):
        stage_data(target, tmp_path / name, [str(prompts)], 4, 0, LAYERS, max_tokens=16, batch=4, seed=0)
        assert main([*common, "--workdir", str(tmp_path / name), *flags]) == 0
        saved = torch.load(tmp_path / name / "train" / "checkpoint.pt", weights_only=False)
        steps = saved["config"]["steps"]
        assert saved["state"]["step"] >= FIT_PROBE_STEPS and (steps < 100_000 if flags else steps == 100_000), (name, steps)
    assert "a schedule of" in capsys.readouterr().out
