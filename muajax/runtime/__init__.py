"""A policy on devices, below the trainer: build it from a config (`build`), load a saved one
(`policy`), save and restore training state (`checkpoint`, `checkpoint_records`,
`checkpoint_errors`, `resume`), lay it out for rollouts (`rollout_engine`), spread it over
processes (`distributed`), and batch for it on the host (`host_batch`: one path from
trajectories to the placed GRPO batch; `packing`: SFT rows). The trainer, the server, the
planner and the commands that only load or plan a policy all stand on this package."""
