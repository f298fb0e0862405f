"""The OpenAI-compatible server behind `python -m muajax.serve` (see `muajax.serve`)."""
