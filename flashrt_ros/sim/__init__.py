"""The simulated arm and the reaching task (no ROS imports).

arm             the MuJoCo model, stepped a control period at a time
task            episodes, the goal, the scripted expert
demonstrations  the expert's episodes (and DAgger's), as sequences to clone
train_policy    make train-policy: clone the policy, export the checkpoint
rollout         a policy engine driving the arm in a closed loop; retries
ablation        the retry ablation as task success, and its picture
"""
