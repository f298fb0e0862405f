"""What the tests share that is not a test itself.

- tiny_models: the tiny Qwen3 configs (TINY_CONFIG, ONE_LAYER_CONFIG), the `model.arch` of
  tiny runs (TINY_ARCH, arch_override) and random HF checkpoints (make_hf_checkpoint);
- fixtures: the session-scoped fixtures (tokenizer, hf_checkpoint, tiny_hf_dir), registered
  by tests/conftest.py;
- workers/: scripts the tests run in fresh processes; step_scenarios runs the train-step one;
- toy_domain, toy_run: a domain and a run small enough to train in seconds;
- openai_server, gold_script: a scripted OpenAI-compatible server and a script that replays
  gold actions through it; mcp_http_server: the demo MCP server over streamable HTTP.
"""
