"""The DFlash drafter: one pass over [bonus, MASK x (B-1)] proposes B-1 future distributions.

It is conditioned on the target's hidden states of the committed tokens: the outputs of target
decoder layers `target_layer_ids` (Hugging Face `hidden_states[id + 1]`), concatenated, then
`fc` (no bias) + RMSNorm, injected as extra keys/values into every drafter layer through that
layer's own k/v projections and k-norm. Attention inside the block is bidirectional. Embedding
and LM head are the target's.

Checkpoint format (the published one, loaded with safetensors, no trust_remote_code):
config.json with qwen3 fields plus `block_size`, `num_target_layers`,
`dflash_config.target_layer_ids`, `dflash_config.mask_token_id`; weights `fc.weight`,
`hidden_norm.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.self_attn.{q,k}_norm.weight`,
`layers.N.{input,post_attention}_layernorm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`,
`norm.weight`; in one model.safetensors or sharded with a model.safetensors.index.json.
`save(layout="published")` writes exactly z-lab's config.json keys (`auto_map` included).
Refused with an error, never run approximately: a target_layer_ids entry that is the target's
last layer (check_target_layer_ids), sliding-window or causal drafter layers, rope types other
than default / linear / llama3 / yarn, DFlash2 and other architectures, and the dflash_config
scalings of NEUTRAL_DFLASH_VALUES other than their neutral values.

One optional addition of ours: a *draft vocabulary*. `dflash_config.draft_vocab_size` = V_d and
an int64 tensor `draft_vocab` [V_d] (sorted token ids) in the weights: the drafter's head is
then the target's LM head restricted to those rows (about 4x cheaper for SmolLM2's 49152), and
every other token gets log-probability -inf. Checkpoints without it load as before. It changes
only which trees are proposed, never which tokens are accepted.

The context cache holds the keys/values of exactly the committed tokens: the block's own keys
are used in the pass and never written to it, so "crop to the committed length after every
draft" holds by construction.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from torch import nn

from ..kernels.batched import top_k_candidates
from ..kernels.tree import Candidates
from .loading import read_safetensors_dir
from .model import (
    MLP, KVCache, Linear, RMSNorm, TargetModel, apply_rope, attend, read_rope, require_full_attention, rope_cos_sin, rope_inv_freq,
)


class Proposer(Protocol):
    """What the drafter backends need from a drafter (the DFlash model, or a test oracle)."""

    block_size: int  # B: the block is [bonus, MASK x (B-1)], so B-1 drafted depths
    target_layer_ids: tuple[int, ...]  # target layers whose outputs the drafter reads

    def new_cache(self, batch: int, slots: int): ...

    def draft(self, cache, features: torch.Tensor, bonus: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """features [B, n, F]: target features of the tokens committed since the last draft
        (their positions are start - n ... start - 1); bonus [B]; start [B] = position of the
        bonus. Returns log-probs [B, B_blk - 1, V] for positions start + 1 ... start + B_blk - 1."""
        ...

    def candidates(self, caches: list, features: list[torch.Tensor], bonus: torch.Tensor, start: torch.Tensor,
                   depths: list[int], top_k: list[int]) -> list[Candidates]:
        """`draft` for R sequences at once, each with its own one-row cache and features
        [1, n_r, F], reduced to what the batch drafter hands the trees: per row r the top_k[r]
        candidates (`top_k_candidates`) of each of its first depths[r] depths."""
        ...


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    draft_vocab_size: int = 0  # 0: the whole vocabulary
    rope_scaling: dict | None = None  # as ModelConfig.rope_scaling (read_rope)
    max_position_embeddings: int = 40960

    @classmethod
    def from_hf(cls, hf: dict) -> "DFlashConfig":
        """Reads a drafter's config.json; refuses what this drafter would run differently from
        the reference (z-lab/dflash): other architectures, sliding-window or causal layers, rope
        types it does not implement, and the extra scalings some newer checkpoints declare."""
        dflash = hf.get("dflash_config") or {}
        if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
            raise ValueError("drafter config.json needs dflash_config.target_layer_ids and .mask_token_id")
        architectures = hf.get("architectures") or ["DFlashDraftModel"]
        if architectures != ["DFlashDraftModel"]:
            raise ValueError(f"drafter architectures {architectures} are not supported; ddtree runs DFlashDraftModel")
        require_full_attention(hf, "drafter")
        if hf.get("is_causal"):
            raise ValueError("drafter config: is_causal true is not supported; DFlash blocks attend bidirectionally")
        changed = {k: dflash[k] for k, same in NEUTRAL_DFLASH_VALUES.items() if k in dflash and not _neutral(dflash[k], same)}
        if changed:
            raise ValueError(f"drafter config: dflash_config {changed} is not supported (it changes the forward)")
        if hf.get("attention_bias"):
            raise ValueError("drafter config: attention_bias true is not supported (DFlash projections have no bias)")
        theta, scaling = read_rope(hf, "drafter")
        heads = hf["num_attention_heads"]
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            block_size=int(hf.get("block_size", dflash.get("block_size", 0))),
            num_target_layers=int(hf["num_target_layers"]),
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            mask_token_id=int(dflash["mask_token_id"]),
            draft_vocab_size=int(dflash.get("draft_vocab_size", 0)),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
        )

    def to_hf(self) -> dict:
        """ddtree's layout: the fields this drafter reads, plus the draft vocabulary's size."""
        dflash = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}
        if self.draft_vocab_size:
            dflash["draft_vocab_size"] = self.draft_vocab_size
        config = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
        }
        if self.rope_scaling:
            config["rope_scaling"] = self.rope_scaling
        return config

    def to_published_hf(self, dtype: torch.dtype, bos_token_id: int | None = None,
                        eos_token_id: int | None = None) -> dict:
        """The published layout (z-lab's Qwen3 DFlash drafters, transformers 4.57): exactly the
        keys of PUBLISHED_CONFIG_KEYS, `auto_map` naming the reference's remote code, and no
        draft vocabulary (the published drafters have none; see DFlashDrafter.save)."""
        if self.draft_vocab_size:
            raise ValueError("the published layout has no draft vocabulary")
        config = {
            "architectures": ["DFlashDraftModel"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": self.block_size,
            "bos_token_id": bos_token_id,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "dtype": str(dtype).removeprefix("torch."),
            "eos_token_id": eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": self.rope_scaling,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "transformers_version": _transformers_version(),
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
        assert set(config) == set(PUBLISHED_CONFIG_KEYS)
        return config


SAVE_LAYOUTS = ("ddtree", "published")

# The keys of z-lab/Qwen3-8B-DFlash-b16's config.json (and its Qwen3 siblings'), in their order.
PUBLISHED_CONFIG_KEYS = (
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "bos_token_id",
    "dflash_config", "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range",
    "intermediate_size", "layer_types", "max_position_embeddings", "max_window_layers", "model_type",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers", "rms_norm_eps",
    "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size",
)

# dflash_config entries of newer checkpoints that change the forward, with the values that leave
# it as it is here; any other value is refused.
NEUTRAL_DFLASH_VALUES = {
    "input_embedding_scale": (1, None),
    "output_multiplier": (1, None),
    "final_logit_softcapping": (0, None),
    "attention_value_scale": (1, None),
    "attention_sink_bias": (False, None),
    "use_swa": (False, None),
    "projector_type": ("dflash", None),
}


def _neutral(value, neutral: tuple) -> bool:
    """value is one of `neutral`; booleans only match booleans (True == 1 in Python)."""
    return any(value is n if isinstance(value, bool) or isinstance(n, bool) else value == n for n in neutral)


def _transformers_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def default_target_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """The target layers a new drafter reads when none are named: early, middle and late, never
    the last (check_target_layer_ids). The one rule for training and for untrained drafters.

    Example: 30 layers (SmolLM2-135M) -> (1, 14, 27); 8 layers -> (1, 3, 5); 2 layers -> (0,).
    """
    top = max(num_target_layers - 2, 0)
    return tuple(sorted({min(max(i, 0), top) for i in (1, num_target_layers // 2 - 1, num_target_layers - 3)}))


def check_target_layer_ids(ids, num_target_layers: int) -> None:
    """The one rule for which target layers a drafter checkpoint may read (the loader and
    training both ask it). A feature is the output of decoder layer i, before the final norm:
    Hugging Face's hidden_states[i + 1], the convention of the reference and of other stacks.
    That holds for every layer but the last, whose hidden_states[L] transformers returns after
    the final norm, so a checkpoint naming it would mean different inputs in different stacks."""
    ids = tuple(ids)
    if not ids or min(ids) < 0 or max(ids) >= num_target_layers:
        raise ValueError(f"target_layer_ids {list(ids)} must lie in [0, {num_target_layers}) (the target's layers)")
    if max(ids) == num_target_layers - 1:
        raise ValueError(
            f"target layer {num_target_layers - 1} is the target's last: transformers returns its output after "
            f"the final norm, not the layer's own, so its features differ between stacks; choose layers below "
            f"{num_target_layers - 1}"
        )


def context_attention(cache: KVCache, layer: int, q, k_blk, v_blk, k_ctx, v_ctx):
    """The drafter's attention over a KVCache holding its context (committed tokens only).
    Appends the new context keys/values k_ctx, v_ctx [B, Hkv, n, D] (or None) after each row's
    committed ones; the block q, k_blk, v_blk [B, heads, S, D] -- never cached -- attends over
    the row's context and the whole block (bidirectional) -> [B, Hq, S, D]. The caller advances
    cache.lengths by n once every layer has run."""
    b, s = q.shape[0], q.shape[2]
    n = k_ctx.shape[2] if k_ctx is not None else 0
    if n:
        slots = (cache.lengths[:, None] + torch.arange(n, device=q.device))[:, None, :, None]
        slots = slots.expand(b, k_ctx.shape[1], n, k_ctx.shape[3])
        cache.k[layer].scatter_(2, slots, k_ctx.to(cache.k.dtype))
        cache.v[layer].scatter_(2, slots, v_ctx.to(cache.v.dtype))
    total = int(cache.lengths.max()) + n
    keys = torch.cat([cache.k[layer, :, :, :total], k_blk], dim=2)
    values = torch.cat([cache.v[layer, :, :, :total], v_blk], dim=2)
    seen = torch.arange(total, device=q.device)[None, :] < (cache.lengths + n)[:, None]
    mask = torch.cat([seen, torch.ones(b, s, dtype=torch.bool, device=q.device)], dim=1)
    return attend(q, keys, values, mask[:, None, None, :])


@dataclass
class _WholeCache:
    """A cache of B rows drafting together, each with the same number of new context tokens."""

    cache: KVCache

    def attend(self, layer: int, q, k_blk, v_blk, k_ctx, v_ctx):
        return context_attention(self.cache, layer, q, k_blk, v_blk, k_ctx, v_ctx)


@dataclass
class RowCaches:
    """Separate one-row caches drafting together: one block per row, the rows' new context
    tokens concatenated (counts[r] of them for row r), attention row by row over each row's own
    context, every projection batched."""

    caches: list[KVCache]  # one-row caches
    counts: list[int]  # new context tokens per row

    def attend(self, layer: int, q, k_blk, v_blk, k_ctx, v_ctx):
        """k_ctx, v_ctx [1, Hkv, sum(counts), D]; q, k_blk, v_blk [R, heads, S, D]."""
        out, at = [], 0
        for r, (cache, n) in enumerate(zip(self.caches, self.counts)):
            part = (k_ctx[:, :, at : at + n], v_ctx[:, :, at : at + n]) if n else (None, None)
            out.append(context_attention(cache, layer, q[r : r + 1], k_blk[r : r + 1], v_blk[r : r + 1], *part))
            at += n
        return torch.cat(out, dim=0)


class DraftAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        """x [B, T, H] -> roped, k-normed keys and values [B, Hkv, T, D]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, block_rope, ctx, ctx_rope, layer: int, cache):  # cache: _WholeCache or RowCaches
        """x [B, S, H] block; ctx [B, n, H] new context (fc + norm of target features)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)
        k_blk, v_blk = self.keys_values(x, *block_rope)
        k_ctx, v_ctx = self.keys_values(ctx, *ctx_rope) if ctx.shape[1] else (None, None)
        out = cache.attend(layer, q, k_blk, v_blk, k_ctx, v_ctx)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward_blocks(self, x, block_rope, ctx, ctx_rope, visible):
        """Training: A blocks at once over one sequence's context, no cache.
        x [A, S, H]; ctx [1, T, H]; visible [A, T] bool (block a sees context < its anchor)."""
        a, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(a, s, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)
        k_blk, v_blk = self.keys_values(x, *block_rope)
        k_ctx, v_ctx = self.keys_values(ctx, *ctx_rope)
        keys = torch.cat([k_ctx.expand(a, -1, -1, -1), k_blk], dim=2)
        values = torch.cat([v_ctx.expand(a, -1, -1, -1), v_blk], dim=2)
        mask = torch.cat([visible, torch.ones(a, s, dtype=torch.bool, device=x.device)], dim=1)
        out = attend(q, keys, values, mask[:, None, None, :])
        return self.o_proj(out.transpose(1, 2).reshape(a, s, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, block_rope, ctx, ctx_rope, layer, cache):
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn(self.input_layernorm(x), block_rope, ctx, ctx_rope, layer, cache))
        return x + self.mlp(h)

    def forward_blocks(self, x, block_rope, ctx, ctx_rope, visible):
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn.forward_blocks(self.input_layernorm(x), block_rope, ctx, ctx_rope, visible))
        return x + self.mlp(h)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig, target: TargetModel):
        super().__init__()
        if config.hidden_size != target.config.hidden_size or config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"drafter (hidden {config.hidden_size}, vocab {config.vocab_size}) does not fit the "
                f"target (hidden {target.config.hidden_size}, vocab {target.config.vocab_size})"
            )
        if max(config.target_layer_ids) >= target.config.num_hidden_layers:
            raise ValueError(f"target_layer_ids {config.target_layer_ids} exceed the target's layers")
        self.config = config
        self.block_size = config.block_size
        self.target_layer_ids = config.target_layer_ids
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        if config.draft_vocab_size:  # filled by load() or set_draft_vocab()
            self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.register_buffer("draft_vocab", None)
        # The target's embedding and LM head, shared, not part of the drafter's weights.
        self._target = (target,)
        self._head = None  # (key, the LM head's rows of the draft vocabulary)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Training: restrict the head to these token ids (sorted, unique)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).unique()
        if int(ids.max()) >= self.config.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size})")
        self.config = replace(self.config, draft_vocab_size=len(ids))
        self.register_buffer("draft_vocab", ids.to(self.fc.weight.device))
        self._head = None

    def draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training labels: each token's index in the draft vocabulary, -100 (ignored by the
        cross-entropy) where it has none. Identity without a draft vocabulary."""
        if self.draft_vocab is None:
            return tokens
        index = torch.full((self.config.vocab_size,), -100, dtype=torch.int64, device=tokens.device)
        index[self.draft_vocab] = torch.arange(len(self.draft_vocab), device=tokens.device)
        return index[tokens]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the whole one by default) for hidden states h: the
        target's LM head, or its draft-vocabulary rows (`select_rows`, made again whenever the
        head's tensors change; a quantized head's rows stay quantized)."""
        target = self._target[0]
        head, h = target.lm_head, h.to(target.dtype)
        if self.draft_vocab is None:
            return head(h)
        tensors = [*head.parameters(), *head.buffers()]
        key = tuple((t.data_ptr(), t.dtype, t.device, t._version) for t in tensors) + (self.draft_vocab.data_ptr(),)
        if self._head is None or self._head[0] != key:
            self._head = (key, head.select_rows(self.draft_vocab.to(tensors[0].device)))
        return self._head[1](h)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)  # see TargetModel._apply
        self.rope = self.rope.to(self.fc.weight.device)
        self._head = None
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, batch: int, slots: int) -> KVCache:
        """The context cache: the same KVCache type as the target's, over the drafter's layers."""
        return KVCache.allocate(self.config, batch, slots, self.dtype, self.fc.weight.device)

    def hidden(self, cache: KVCache, features, bonus, start) -> torch.Tensor:
        """The drafter's final hidden states [B, S, H] for the block at positions start + i;
        appends the context keys/values of `features` to `cache`."""
        n = features.shape[1]
        if not torch.equal(cache.lengths + n, start):
            raise ValueError(f"drafter cache holds {cache.lengths.tolist()} tokens + {n} new, but the bonus sits at {start.tolist()}")
        ctx_pos = cache.lengths[:, None] + torch.arange(n, device=bonus.device)
        x = self._run(features, bonus, start, ctx_pos, _WholeCache(cache))
        cache.lengths += n
        return x

    def _run(self, features, bonus, start, ctx_pos, cache) -> torch.Tensor:
        """The layers over blocks [bonus, MASK...] at start + i, given new context features at
        positions ctx_pos (shapes as `cache` lays them out) -> final hidden states [B, S, H]."""
        target = self._target[0]
        s = self.block_size
        block = torch.full((bonus.shape[0], s), self.config.mask_token_id, dtype=torch.int64, device=bonus.device)
        block[:, 0] = bonus
        x = target.model.embed_tokens(block).to(self.dtype)
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        block_rope = rope_cos_sin(start[:, None] + torch.arange(s, device=bonus.device), self.rope, self.dtype)
        ctx_rope = rope_cos_sin(ctx_pos, self.rope, self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, block_rope, ctx, ctx_rope, i, cache)
        return self.norm(x)

    def block_logits(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training (differentiable): the drafter's logits for blocks at `anchors` of one
        sequence, exactly as drafting there would see them. features [T, F] (target features of
        tokens [T]); anchors [A] -> logits [A, S-1, V_d] for positions anchor + 1 ... + S - 1,
        over the draft vocabulary (labels: draft_ids). Block a is [tokens[a], MASK x (S-1)] and
        sees the context features of positions < a."""
        target = self._target[0]
        s, t = self.block_size, tokens.shape[0]
        steps = torch.arange(s, device=tokens.device)
        block = torch.full((anchors.shape[0], s), self.config.mask_token_id, dtype=torch.int64, device=tokens.device)
        block[:, 0] = tokens[anchors]
        x = target.model.embed_tokens(block).to(self.dtype)
        ctx = self.hidden_norm(self.fc(features[None].to(self.dtype)))
        block_rope = rope_cos_sin(anchors[:, None] + steps, self.rope, self.dtype)
        ctx_rope = rope_cos_sin(torch.arange(t, device=tokens.device)[None], self.rope, self.dtype)
        visible = torch.arange(t, device=tokens.device)[None, :] < anchors[:, None]
        for layer in self.layers:
            x = layer.forward_blocks(x, block_rope, ctx, ctx_rope, visible)
        return self.head(self.norm(x[:, 1:]))

    @torch.inference_mode()
    def draft_rows(self, caches: list[KVCache], features: list[torch.Tensor], bonus, start,
                   depths: int | None = None) -> torch.Tensor:
        """Many sequences' drafts in one pass: caches[r] is row r's one-row cache, features[r]
        [1, n_r, F] its new target features, bonus [R], start [R] -> log-probs [R, B_blk - 1, V]
        (each row what `draft` would give it alone, up to float summation order). With `depths`,
        the head and log-softmax run for the first `depths` positions only -> [R, depths, V]:
        a tree of n nodes reaches depth n at most (with the shipped 8-token block at budget 4,
        a draft pass 12.4-13.5 ms against 15.4 over native weights on the 2-core CPU)."""
        x = self._rows_hidden(caches, features, bonus, start)
        last = x.shape[1] if depths is None else min(x.shape[1], 1 + depths)
        logprobs = torch.log_softmax(self.head(x[:, 1:last]).double(), dim=-1)
        return self._to_vocab(logprobs)

    @torch.inference_mode()
    def candidates(self, caches: list[KVCache], features: list[torch.Tensor], bonus, start,
                   depths: list[int], top_k: list[int]) -> list[Candidates]:
        """`draft_rows` and each row's top_k[r] per depth (`top_k_candidates`), for row r's own
        first depths[r] positions: the head and log-softmax run over those rows alone, packed,
        and the top-k is taken over the draft vocabulary before its ids become token ids (sorted
        ids: equal values still rank by token id), never over a [R, D, V] tensor of -inf. At 4
        streams `budget: auto`'s rows asked 4-7 depths each and the pass ran the head for the
        deepest of them on every row. One top-k over the rows of every sequence that asks the same
        k: one per sequence cost ~0.3 ms each (4 depths) in its half-dozen small ops, most of it
        what each op costs whatever its size."""
        x = self._rows_hidden(caches, features, bonus, start)
        depths = [max(0, min(d, x.shape[1] - 1)) for d in depths]
        rows = torch.cat([x[r, 1:1 + d] for r, d in enumerate(depths)])
        logprobs = torch.log_softmax(self.head(rows).double(), dim=-1)
        vocab = self.draft_vocab.cpu() if self.draft_vocab is not None else None
        starts = list(itertools.accumulate(depths, initial=0))  # row r's first depth row
        out: list[Candidates | None] = [None] * len(depths)
        for k in sorted(set(top_k)):  # one top-k over the rows of every sequence asking this k
            same = [r for r, want in enumerate(top_k) if want == k]
            found = top_k_candidates(logprobs if len(same) == len(depths) else
                                     torch.cat([logprobs[starts[r] : starts[r] + depths[r]] for r in same]), k)
            tokens = found.tokens
            if vocab is not None and tokens:
                tokens = vocab[torch.tensor(tokens)].tolist()
            at = 0
            for r in same:
                out[r] = Candidates(found.logprobs[at : at + depths[r]], tokens[at : at + depths[r]])
                at += depths[r]
        return out

    def _rows_hidden(self, caches: list[KVCache], features: list[torch.Tensor], bonus, start) -> torch.Tensor:
        """The final hidden states [R, B_blk, H] of `draft_rows`' pass; appends each row's new
        context to its cache."""
        dev = self.fc.weight.device
        counts = [f.shape[1] for f in features]
        for cache, n, at in zip(caches, counts, start.tolist()):
            if int(cache.lengths[0]) + n != at:
                raise ValueError(f"drafter cache holds {int(cache.lengths[0])} tokens + {n} new, but the bonus sits at {at}")
        bonus, start = bonus.to(dev), start.to(dev)
        ctx_pos = torch.cat([int(c.lengths[0]) + torch.arange(n) for c, n in zip(caches, counts)])[None].to(dev)
        x = self._run(torch.cat(features, dim=1).to(dev), bonus, start, ctx_pos, RowCaches(caches, counts))
        for cache, n in zip(caches, counts):
            cache.lengths += n
        return x

    @torch.inference_mode()
    def draft(self, cache: KVCache, features, bonus, start) -> torch.Tensor:
        logprobs = torch.log_softmax(self._logits(cache, features, bonus, start).double(), dim=-1)
        return self._to_vocab(logprobs)

    @torch.inference_mode()
    def draft_logits(self, cache: KVCache, features, bonus, start) -> torch.Tensor:
        """The block's logits [B, B_blk - 1, V] (draft() is their log-softmax); -inf for
        tokens outside the draft vocabulary."""
        return self._to_vocab(self._logits(cache, features, bonus, start))

    def _logits(self, cache: KVCache, features, bonus, start) -> torch.Tensor:
        dev = self.fc.weight.device  # inputs may come from another device or process
        features, bonus, start = features.to(dev), bonus.to(dev), start.to(dev)
        return self.head(self.hidden(cache, features, bonus, start)[:, 1:])

    def _to_vocab(self, values: torch.Tensor) -> torch.Tensor:
        """Values over the draft vocabulary -> over the whole one, -inf for the rest."""
        if self.draft_vocab is None:
            return values
        full = values.new_full((*values.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(values.device), values)

    # --- checkpoints ----------------------------------------------------------------------

    def save(self, directory: str | Path, layout: str = "ddtree", bos_token_id: int | None = None,
             eos_token_id: int | None = None) -> None:
        """Writes config.json + model.safetensors in one of SAVE_LAYOUTS:

        - "ddtree" (default): DFlashConfig.to_hf, and the draft vocabulary when there is one
          (`dflash_config.draft_vocab_size` + a `draft_vocab` tensor), which ddtree loads back;
        - "published": exactly what z-lab publishes (DFlashConfig.to_published_hf: its keys,
          `auto_map`; only the drafter's own tensors), loadable by the reference and other
          stacks. A drafter with a draft vocabulary is refused rather than widened: widening
          would let tokens it was never trained to rank compete in its head."""
        if layout not in SAVE_LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {', '.join(SAVE_LAYOUTS)}")
        if layout == "published" and self.draft_vocab is not None:
            raise ValueError(
                f"this drafter has a draft vocabulary ({self.config.draft_vocab_size} of {self.config.vocab_size} "
                "tokens), which the published layout cannot carry; save it with layout 'ddtree', or train with "
                "the whole vocabulary (--vocab-floor -1) to export the published layout"
            )
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = (
            self.config.to_published_hf(self.dtype, bos_token_id, eos_token_id)
            if layout == "published"
            else self.config.to_hf()
        )
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: t.detach().contiguous() for k, t in self.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, directory: str | Path, target: TargetModel) -> "DFlashDrafter":
        """A drafter checkpoint in either layout, its weights in one file or sharded
        (model-0000i-of-0000n.safetensors + model.safetensors.index.json)."""
        directory = Path(directory)
        config = DFlashConfig.from_hf(json.loads((directory / "config.json").read_text()))
        check_target_layer_ids(config.target_layer_ids, target.config.num_hidden_layers)
        state = read_safetensors_dir(directory)
        drafter = cls(config, target).to(target.dtype)
        drafter.load_state_dict({k: t.to(target.dtype) if t.is_floating_point() else t for k, t in state.items()}, strict=True)
        return drafter.eval()

    @classmethod
    def untrained(
        cls, target: TargetModel, block_size: int = 8, num_layers: int = 1, seed: int = 0
    ) -> "DFlashDrafter":
        """A seeded, randomly initialised drafter for `target`: lossless, just slow to accept.
        It reads the default target layers (default_target_layer_ids), and uses the last
        vocabulary id as its mask token."""
        t = target.config
        layers = t.num_hidden_layers
        ids = default_target_layer_ids(layers)
        config = DFlashConfig(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads,
            head_dim=t.head_dim,
            vocab_size=t.vocab_size,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta,
            block_size=block_size,
            num_target_layers=layers,
            target_layer_ids=ids,
            mask_token_id=t.vocab_size - 1,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = cls(config, target)
            for module in drafter.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
        return drafter.to(target.dtype).eval()
