"""One trajectory: the chat format, call routing, the conversation state machine, the
rollout driver, the trajectory record and pass^k evaluation."""
