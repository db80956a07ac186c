"""The error every layer raises for input a user must fix."""


class ConfigError(ValueError):
    """A config value, experiment hook or input that cannot work; the message is one line
    naming the field (or function), the value found and the fix."""
