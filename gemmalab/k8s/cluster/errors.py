"""The one error of the local cluster: a single line saying what failed and the fix."""

from __future__ import annotations


class ClusterError(RuntimeError):
    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")
