"""BFCL-v3 multi-turn (nvidia-bfcl, an optional install): its environment, checker and scripted user turns."""
