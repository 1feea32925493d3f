"""proto-server: an OpenAI Responses API server built around one long-lived Response per rollout."""

__version__ = "0.1.0"
