"""Rollouts: how an iteration's samples are generated (a sample generator under a schedule) and what observes them
(the sample table, the dump)."""
