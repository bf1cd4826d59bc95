"""make demo: the robot scenario, driven over DDS against flashrt_node in its own process."""
