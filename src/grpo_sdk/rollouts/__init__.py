"""Rollouts: what turns prompts into scored rollouts for the step.

One step's rollouts (``step_rollouts``): draw prompts, play their episodes (``rollout``,
``episodes``, ``environment_step``; an agent environment's over the rollout endpoint,
``agent_rollouts``), score and shape the rewards. The asynchronous loop's side of it: the
trajectory collector (``collector``, on Ray as an actor: ``collector_worker``), the replay buffer
(``replay_buffer``) and the trainer's handle on both (``async_rollouts``).

Modules here import torch themselves; importing the package does not.
"""
