"""Prompt datasets with their verifiers: the built-in arithmetic task, or local dataset files
(:func:`asyncflow.tasks.loader.load_task` builds the one a configuration names)."""

from asyncflow.tasks.base import Problem, Task

__all__ = ["Problem", "Task"]
