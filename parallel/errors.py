"""The one exception type for bad user input (config, data, checkpoint).

It lives at the bottom layer so every package can raise it; `train.py` turns it into one line on
stderr and a non-zero exit, before any collective can hang.
"""


class ConfigError(ValueError):
    """Bad user input. The message names the key and the constraint, in one line."""
