"""The error every layer raises for input a user must fix, and how other errors are
quoted inside such a one-line message."""


class ConfigError(ValueError):
    """A config value, experiment hook or input that cannot work; the message is one line
    naming the field (or function), the value found and the fix."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """`error`'s message as it is quoted in a one-line report: its first non-empty line,
    at most `limit` characters (the exception's type name when it has no message)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(error).__name__


def quoted(error: BaseException, limit: int = 120) -> str:
    """`error` as one line for a table or a log line: its type and first line, with a
    refusal of input named `ConfigError` whatever private subclass raised it."""
    name = ConfigError.__name__ if isinstance(error, ConfigError) else type(error).__name__
    return f"{name}: {first_line(error, limit)}"
