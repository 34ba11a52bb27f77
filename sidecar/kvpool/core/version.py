"""The version of kvpool: one definition, read by the package, the CLI and the wire greetings."""

__version__ = "0.1.0"
