"""The error kinds every layer raises, and the one boundary (`cli.run`) turns into exit codes.

The bottom of the package: it imports nothing of ours, so the model, data, parallel and training
layers can say what went wrong without reaching up to the command line.
"""


class UsageError(ValueError):
    """Bad input the user can fix, said in one line naming the file, field or value (exit 2)."""


class ConfigError(UsageError):
    """A gin file or binding that cannot be used, in one line."""


class RunFault(RuntimeError):
    """A run that cannot go on for a reason of its own, not bad input; what it saved is safe
    (exit 1)."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """What a third-party failure says, cut to its first line (jax's and XLA's run to pages)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]
