"""Tree ops: plain torch references (Triton kernels join them later)."""
