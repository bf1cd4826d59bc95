"""flashrt_ros: checkpoint the whole execution state of an on-device model.

This file must stay free of ROS imports: ``flashrt_ros.runtime`` and
``flashrt_ros.capsule`` are installable with a plain ``pip install -e .``.
colcon generates ``flashrt_ros.msg``, ``flashrt_ros.srv`` and
``flashrt_ros.action`` beside it.
"""
