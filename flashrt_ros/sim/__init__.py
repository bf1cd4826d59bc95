"""The simulated arm and its tasks (no ROS imports).

arm                   the MuJoCo model, stepped a control period at a time
task                  the reaching task: episodes, the goal, the scripted expert
demonstrations        the reaching expert's episodes (and DAgger's), as sequences to clone
train_policy          make train-policy: clone the reaching policy, export the checkpoint
rollout               a policy engine driving the arm in a closed loop; retries
ablation              the retry ablation as task success, and its picture
waypoints             the waypoint task: a route given once, visited in order; its judge and expert
interruption          an urgent request in the middle of a route, and the ways to resume after it
route_demonstrations  the waypoint expert's routes, resumes included, as sequences to clone
train_resume_policy   make train-resume-policy: clone the waypoint policy, export the checkpoint
resume_ablation       the resume ablation: success, periods to heading, time to resume; its picture
"""
