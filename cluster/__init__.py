"""GPU topology, placement, KubeRay and Serve configs (not built yet)."""
