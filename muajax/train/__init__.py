"""The run: its context, one step loop with hooks, the SFT, pre-training and GRPO stages,
metrics, and the in-run evaluation; a policy on devices (building, checkpoints, the
rollout engine, multi-host batches) is `muajax.runtime`'s.

`python -m muajax.train` runs `__main__`."""
