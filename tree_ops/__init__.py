"""Tree ops: building a draft tree, its attention mask and positions, tree attention, the greedy
and seeded walks, KV compaction and the drafter's top-K. Each is a plain torch reference (the
CPU path, and the oracle in tests) and, over a batch of trees, a Triton kernel that CUDA tensors
are dispatched to. Imported as `ddtree.kernels` (pyproject's package-dir maps this folder)."""
