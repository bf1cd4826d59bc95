"""py_trees behaviours for the flashrt node: capsule services and generate, plus example trees."""
