"""Tuning results shipped with duotile: ``tuning.json``, written by ``duotile tune`` on our H200
(``benchmarks/gpu_run.sh tune``) and read, after the user's own cache, by
``duotile.codegen.choose_config``. Entries match only the toolchain and kernel IR they were
measured with; a GPU's own entries come first, and another GPU's of the same target serve a GPU
(or a CPU build) that has none."""
