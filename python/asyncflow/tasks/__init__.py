"""Prompt datasets with their verifiers: the built-in arithmetic task, or local dataset files."""

from asyncflow.tasks.base import Problem, Task
from asyncflow.tasks.loader import load_task

__all__ = ["Problem", "Task", "load_task"]
