"""The run: build (mesh, model, params), one step loop with hooks, SFT, warm-ups and GRPO
stages, the rollout engine's role, checkpoints, policy loading, multi-host and metrics.

`python -m muajax.train` runs `__main__`."""
