"""trio: one listener, a nursery per connection, the dialects; moves bytes, owns lifetimes."""
