"""The project's error type for bad input: it names the key, the problem and the fix."""


class ConfigError(ValueError):
    """Bad configuration or input data, reported as "<key>: <problem>. Fix: <fix>"."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        super().__init__(key, problem, fix)  # keeps the error picklable across processes
        self.key = key
        self.problem = problem.rstrip(".")
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.key}: {self.problem}. Fix: {self.fix}"
