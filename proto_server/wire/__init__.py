"""Bytes <-> typed events and items: attrs classes, one cattrs converter, typed errors."""
