"""Domains: what an agent acts in. Each is an environment (policy, tools, tasks, a fresh
session per rollout) and a simulated user, behind the interface in `base`; `registry`
builds one from a run config."""
