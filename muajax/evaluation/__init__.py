"""Evaluating a saved policy outside a training run (`python -m muajax.eval` and the τ2
protocol server): `saved_policy` loads it, rolls out each domain's held-out tasks with
the benchmark's rules, and writes the reports; `--policy gold` replays the gold actions."""
