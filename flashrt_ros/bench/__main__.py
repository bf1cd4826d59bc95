"""``python -m flashrt_ros.bench``: run every benchmark module in turn."""
from . import capsules, runtime

if __name__ == "__main__":
    runtime.run()
    capsules.run()
    try:
        import rclpy  # noqa: F401

        from . import ros_services
    except ImportError as exc:  # the ROS-free install (pip install -e .) has no rclpy
        print(f"== ROS service overhead: skipped ({exc})")
    else:
        ros_services.run()
