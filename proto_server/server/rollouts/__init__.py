"""A Response's life: checked and built from a create, sampled in its nursery, suspended on a
tool, stored, resumed, and admitted by the engines' KV capacity."""
