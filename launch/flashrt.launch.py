"""Start flashrt_node: ros2 launch flashrt_ros flashrt.launch.py [params_file:=...] [namespace:=...]
[log_level:=info] [autostart:=true|false]."""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode

from flashrt_ros.ros.launch_args import node_parameters


def _node(context):
    return [LifecycleNode(
        package="flashrt_ros",
        executable="flashrt_node",
        name="flashrt",
        namespace=LaunchConfiguration("namespace"),
        output="screen",
        parameters=node_parameters(LaunchConfiguration("params_file").perform(context),
                                   LaunchConfiguration("autostart").perform(context)),
        arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
    )]


def generate_launch_description() -> LaunchDescription:
    default_params = os.path.join(get_package_share_directory("flashrt_ros"), "config", "flashrt.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="parameters file (default: the installed config/flashrt.yaml)"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("log_level", default_value="info", description="debug, info, warn, error"),
        DeclareLaunchArgument("autostart", default_value="",
                              description="true: configure and activate at start; false: leave it to a lifecycle "
                                          "manager; empty (default): the params file's autostart decides"),
        OpaqueFunction(function=_node),
    ])
