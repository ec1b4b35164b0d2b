"""`ddtree train-drafter`: self-distil a DFlash drafter for a target, in three resumable stages,
and measure a drafter (`ddtree eval-drafter`).

    workdir/
      data/prompts.json                  the prompts of every shard (stage 1, fixed once planned)
      data/shard-00000.safetensors ...   the target's greedy responses + features (stage 1)
      data/teacher-00000.safetensors ... its top-32 distribution at every response token (stage 2, --distill)
      train/checkpoint.pt                drafter + optimizer + scheduler + step (stage 2, rewritten as it goes)
      export/                            the drafter in the published DFlash format + README.md

1. data (data.py): prompts from JSONL files (`question`, `turns[0]` or `prompt`) and prompts the
   target writes itself (the chat template's opening of a user turn, sampled with temperature,
   after a short opener so chat, code and math are all covered); the target answers greedily, in
   batches, and the outputs of its layers `target_layer_ids` are captured during generation.
2. train (train.py): the DFlash recipe: random anchors inside the responses; block [token at
   anchor, MASK x (B-1)]; context features strictly before the anchor; bidirectional attention in
   the block; label at block position k = token at anchor + k; cross-entropy weighted by
   exp(-(k-1)/gamma); the target, its embedding and LM head frozen; AdamW, linear warmup, cosine
   decay to a tenth of the peak learning rate. With `distill` > 0 the loss also takes the
   target's own distribution at each position (teacher.py: data/teacher-*.safetensors, made once
   before the first step from the captured features).
3. export (export.py): the checkpoint directory (bf16 safetensors) and a model card; ddtree's
   layout by default, or exactly the published one (`--export-layout published`).

evaluate.py: held-out tau per budget and top-1 accuracy per block position, from the target's
own greedy continuations and the drafts along them.
"""

from .data import load_sequences, plan_prompts, stage_data, stage_features
from .evaluate import drafts_report, eval_drafter, reference_continuations
from .export import stage_export
from .train import TrainConfig, TrainState, block_loss, init_drafter, position_weights, sample_anchors, stage_train

__all__ = [
    "TrainConfig", "TrainState", "block_loss", "drafts_report", "eval_drafter", "init_drafter", "load_sequences",
    "plan_prompts", "position_weights", "reference_continuations", "sample_anchors", "stage_data", "stage_export",
    "stage_features", "stage_train",
]
