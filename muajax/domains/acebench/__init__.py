"""ACEBench Agent (multi-turn and multi-step) from a checkout the user points at."""
