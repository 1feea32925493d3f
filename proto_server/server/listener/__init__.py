"""The top of the server: the listener, what each connection becomes (a WebSocket's dialect,
HTTP requests one after another, a 503 past the cap), and the supervisor of `--workers`."""
