"""The models and the loops that run them: our own llama / qwen3 target code and the DFlash
drafter (loaded from Hugging Face safetensors or a GGUF file), the batched step loop over a paged
KV pool and the per-request speculative loop, and the distributed engine: Ray actors for the
scheduler, the drafter and the tensor-parallel target shards."""
