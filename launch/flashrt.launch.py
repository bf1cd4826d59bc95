"""Start flashrt_node: ros2 launch flashrt_ros flashrt.launch.py [params_file:=...] [namespace:=...]
[log_level:=info] [autostart:=true]."""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue


def generate_launch_description() -> LaunchDescription:
    default_params = os.path.join(get_package_share_directory("flashrt_ros"), "config", "flashrt.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="parameters file (defaults: the installed config/flashrt.yaml)"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("log_level", default_value="info", description="debug, info, warn, error"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="configure and activate at start (false: leave it to a lifecycle manager)"),
        LifecycleNode(
            package="flashrt_ros",
            executable="flashrt_node",
            name="flashrt",
            namespace=LaunchConfiguration("namespace"),
            output="screen",
            parameters=[LaunchConfiguration("params_file"),
                        {"autostart": ParameterValue(LaunchConfiguration("autostart"), value_type=bool)}],
            arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
        ),
    ])
