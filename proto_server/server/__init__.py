"""trio: one listener, one nursery per connection, the dialects. Only moves bytes and owns lifetimes."""
