"""The expert's demonstrations of the reaching task, as sequences a policy is cloned from.

Each demonstration is one attempt: the goal step (the observation that carries the goal), then
``ATTEMPT_STEPS`` observations, each labelled with the expert's targets. In a ``retry`` share of
them the arm is somewhere else after the goal step: it moved, was jammed and then freed, and
those steps are not in the sequence. That is the history a policy whose state was rolled back to just
after the goal finds on a retry, and the demonstrations show it that the goal still holds.

The arm is driven with the expert's targets plus noise, and each step is labelled with the
expert's own targets: the demonstrations then visit the states a policy's small errors lead
to, and say how to come back from them (Laskey et al., 2017, "DART").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .arm import Arm
from .task import ATTEMPT_STEPS, Episode, expert, observe

RETRY_SHARE = 0.5
NOISE_RAD = 0.1   # spread of the noise added to the targets the arm is driven with (not to the labels)


@dataclass(frozen=True)
class Demonstrations:
    """``observations`` [n, steps, OBS_DIM] and the expert's ``targets`` [n, steps, ACTION_DIM],
    float32; ``targets[:, t]`` answers ``observations[:, t]``."""
    observations: np.ndarray
    targets: np.ndarray


def demonstrate(seeds: range, arm: Arm | None = None, policy: Any = None) -> Demonstrations:
    """The expert's episodes of ``seeds``; with a ``policy`` (an engine), the arm is driven by
    the policy instead and every step still labelled by the expert: the states the policy's own
    mistakes lead to, with what it should have done there (Ross et al., 2011, "DAgger")."""
    arm = arm or Arm()
    observations, targets = [], []
    for seed in seeds:
        episode = Episode.sample(seed)
        rng = np.random.default_rng(seed + 7919)   # a stream of its own: Episode.sample draws from seed
        if policy is not None:
            policy.reset()
        state = arm.reset(episode.start)
        obs, act = [observe(state, episode.goal)], [expert(state, episode.goal)]
        arm.command(_driven(policy, obs[-1], act[0], rng, arm))
        state = arm.advance()
        taken_in = policy.snapshot() if policy is not None else None
        if rng.random() < RETRY_SHARE:   # a few steps, then jammed for a while, off the record; freed
            free = int(rng.integers(0, 4))
            for k in range(free + int(rng.integers(2, ATTEMPT_STEPS))):
                if k == free:
                    arm.block(0)
                arm.command(_driven(policy, observe(state, None), expert(state, episode.goal), rng, arm))
                state = arm.advance()
            arm.unblock()
            if policy is not None:   # the policy's state as a rollback to the goal step leaves it
                policy.restore(taken_in.id)
        for _ in range(ATTEMPT_STEPS):
            obs.append(observe(state, None))
            act.append(expert(state, episode.goal))
            arm.command(_driven(policy, obs[-1], act[-1], rng, arm))
            state = arm.advance()
        if taken_in is not None:
            policy.capsules.drop(taken_in.id)
        observations.append(obs)
        targets.append(act)
    return Demonstrations(np.asarray(observations, dtype=np.float32), np.asarray(targets, dtype=np.float32))


def _driven(policy: Any, observation: np.ndarray, label: np.ndarray, rng: np.random.Generator, arm: Arm) -> np.ndarray:
    """The targets the arm is driven with: the policy's, or the expert's ``label`` plus noise."""
    if policy is not None:
        target = policy.step(observation).double().numpy()
    else:
        target = label + rng.normal(0.0, NOISE_RAD, size=label.shape)
    return np.clip(target, arm.lower, arm.upper)
