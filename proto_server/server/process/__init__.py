"""What the whole process shares: its settings, its tenants and secret, its memory budget, the
threads that work off the event loop, its metrics and its logs."""
