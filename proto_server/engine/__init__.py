"""The token generator ("the GPU"): a session per rollout that prefills, decodes and pauses."""
