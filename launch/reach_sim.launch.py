"""The reaching task in simulation: ros2 launch flashrt_ros reach_sim.launch.py [speed:=1.0]
[lockstep:=false] [seed:=0].

Starts flashrt_sim (the MuJoCo arm, publishing /clock) and flashrt_node with the trained
reaching policy (config/reach_sim.yaml, model data/policies/reach_arm), wired together: the arm's
joint_states and ee_pose are the policy's inputs, the policy's joint_trajectory the arm's
command. Then run the behaviour tree: python -m flashrt_ros.bt.reach
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode, Node


def generate_launch_description() -> LaunchDescription:
    share = get_package_share_directory("flashrt_ros")
    wiring = [("joint_states", "/flashrt/joint_states"), ("ee_pose", "/flashrt/ee_pose"),
              ("joint_trajectory", "/flashrt/joint_trajectory")]
    return LaunchDescription([
        DeclareLaunchArgument("speed", default_value="1.0", description="simulation speed, a multiple of real time"),
        DeclareLaunchArgument("lockstep", default_value="false",
                              description="true: step once the policy answered (deterministic, as fast as it runs)"),
        DeclareLaunchArgument("seed", default_value="0", description="episode seed (reset with ~/reset)"),
        Node(package="flashrt_ros", executable="flashrt_sim", name="flashrt_sim", output="screen",
             remappings=wiring,
             parameters=[{"speed": LaunchConfiguration("speed"), "lockstep": LaunchConfiguration("lockstep"),
                          "seed": LaunchConfiguration("seed")}]),
        LifecycleNode(package="flashrt_ros", executable="flashrt_node", name="flashrt", namespace="",
                      output="screen",
                      parameters=[os.path.join(share, "config", "reach_sim.yaml"),
                                  {"model_path": os.path.join(share, "data", "policies", "reach_arm")}]),
    ])
