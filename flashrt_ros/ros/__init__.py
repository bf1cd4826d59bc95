"""The ROS 2 side: the lifecycle node and its helpers. Everything here may import rclpy."""
