"""muajax: MUA-RL in JAX."""
