"""The benchmarks: one script a question (docs/benchmarks.md). What they share: `as_flags`."""


def as_flags(values: dict) -> list[str]:
    """A run's command-line flags from {flag name: value} (e.g. {"num_steps": 3} -> ["--num-steps", "3"]); None: left
    out."""
    flags = []
    for key, value in values.items():
        if value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags
