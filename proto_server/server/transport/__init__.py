"""Bytes on a socket: a request head read once, HTTP/1.1 with h11, WebSocket and SSE framing,
and the one writer that drains a client channel into its transport."""
