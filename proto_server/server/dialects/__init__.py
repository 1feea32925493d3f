"""What the bytes mean: the WebSocket dialects (their registry, their lanes, prototype and
launched) and the HTTP routes of the Responses API."""
