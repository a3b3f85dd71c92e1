"""One error type for bad user input: a single line naming the parameter and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input, detected before any expensive work starts.

    The message is one line: ``<parameter>: <what is wrong>. <how to fix it>``.
    In Jupyter it renders as that single line instead of a stack trace.
    """

    def __init__(self, parameter: str, problem: str, fix: str):
        self.parameter = parameter
        self.problem = problem
        self.fix = fix
        super().__init__(f"{parameter}: {problem}. Fix: {fix}")

    # IPython calls this instead of printing the traceback: researchers see the fix, not a stack.
    def _render_traceback_(self) -> list[str]:
        return [f"ConfigError: {self}"]


def require(condition: bool, parameter: str, problem: str, fix: str) -> None:
    """Raise ``ConfigError`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(parameter, problem, fix)


class TrainingDiverged(FloatingPointError):
    """The loss or gradient norm stopped being finite; one line, naming where to resume from."""

    def _render_traceback_(self) -> list[str]:
        return [f"TrainingDiverged: {self}"]
