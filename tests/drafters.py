"""Oracle drafters for losslessness tests. They follow the same Proposer protocol as the DFlash
drafter but know the target's own greedy continuation, so acceptance can be steered."""

from __future__ import annotations

import torch

from ddtree.kernels.tree import Candidates


class OracleDrafter:
    """Proposes, for depth d below the bonus at position `start`, a distribution peaked on the
    target's greedy token at position start + d with probability `accuracy` (else on another
    token), plus seeded noise over the rest of the vocabulary.

    accuracy 1.0 is the "perfect" drafter (one-hot on the target's continuation)."""

    def __init__(self, sequence: list[int], vocab: int, block_size: int, accuracy: float, seed: int = 0):
        self.sequence = sequence  # prompt + the target's greedy continuation (long enough)
        self.vocab = vocab
        self.block_size = block_size
        self.target_layer_ids = (0,)
        self.accuracy = accuracy
        self.seed = seed

    def new_cache(self, batch: int, slots: int):
        return None

    def candidates(self, caches, features, bonus, start, depths, top_k):
        logprobs = self.draft(None, None, bonus, start)
        return [Candidates.top_k(logprobs[r, :d], k) for r, (d, k) in enumerate(zip(depths, top_k))]

    def draft(self, cache, features, bonus, start):
        depths = self.block_size - 1
        out = torch.empty(len(start), depths, self.vocab, dtype=torch.float64)
        for row, s in enumerate(start.tolist()):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + s)
            logits = torch.randn(depths, self.vocab, generator=g, dtype=torch.float64)
            for d in range(1, depths + 1):
                pos = s + d
                truth = self.sequence[pos] if pos < len(self.sequence) else 0
                right = float(torch.rand((), generator=g)) < self.accuracy
                wrong = (truth + 1 + int(torch.randint(self.vocab - 1, (), generator=g))) % self.vocab
                logits[d - 1, truth if right else wrong] += 12.0
            out[row] = torch.log_softmax(logits, dim=-1)
        return out
