"""The commands of ``mpiscale``: one registry (``COMMANDS``) from which the parser, the help lists and the guide's
table are built, and the handlers of the commands that are not jobs or benchmarks."""

from .registry import COMMANDS, GROUPS, Command, Option, arg, children, commands_table

__all__ = ["COMMANDS", "GROUPS", "Command", "Option", "arg", "children", "commands_table"]
