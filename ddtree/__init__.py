"""ddtree: lossless tree speculative decoding (a DFlash drafter + DDTree draft trees), served on
Ray Serve.

Here: the command line (`cli`), the validated configuration (`config`), the engine a CLI run or
a Serve replica builds (`engine`), `budget: auto` (`calibrate`), the benchmarks and drafter
training. Subpackages (top-level folders mapped by pyproject.toml): `workers` (model code, the
step loop, the distributed engine's Ray actors), `kernels` (tree ops: torch references and their
Triton kernels), `serve` (the Serve application, OpenAI API), `cluster` (GPU topology, placement
planning, deploy configs), `dashboards` (Grafana).
"""

__version__ = "0.1.0"
