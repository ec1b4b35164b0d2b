"""Where ddtree runs: GPU topology (`nvidia-smi topo -m`) and placement planning (`ddtree plan`:
TP x PP, replicas, and the placement group the distributed engine makes), plus the deploy
configs beside them: serve-config.yaml, the KubeRay RayServices and PodMonitor, prometheus.yml
and the Dockerfile."""
