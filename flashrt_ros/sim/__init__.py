"""A simulated arm for a task that needs memory (no ROS imports): the MuJoCo model's wrapper
(``arm``), the reaching task and its scripted expert (``task``)."""
