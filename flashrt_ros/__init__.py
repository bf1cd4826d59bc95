"""flashrt_ros: checkpoint the whole execution state of an on-device model.

This file must stay free of ROS imports: ``flashrt_ros.runtime`` and
``flashrt_ros.capsule`` are installable with a plain ``pip install -e .``.
colcon generates ``flashrt_ros.msg``, ``flashrt_ros.srv`` and
``flashrt_ros.action`` beside it.
"""
from pkgutil import extend_path

# Run from a source checkout (``python -m flashrt_ros.bt.examples`` at the repository root),
# this folder comes first on sys.path but lacks what colcon generates and compiles (msg, srv,
# action, the C libraries): the installed copy of the package further along sys.path
# supplies those. Its Python modules are this folder's own files (colcon --symlink-install).
__path__ = extend_path(__path__, __name__)
