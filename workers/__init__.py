"""Ray actors, model code and the speculative loop."""
