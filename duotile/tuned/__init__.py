"""Tuning results shipped with duotile: ``tuning.json``, written by ``duotile tune`` on our H200
(``benchmarks/gpu_run.sh tune``) and read, after the user's own cache, by
``duotile.passes.autotune.cache.best_config``. Entries match only the device, toolchain and
kernel IR they were measured with."""
