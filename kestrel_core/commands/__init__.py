"""Subcommands of ``kestrel``: each module has HELP, add_arguments(parser) and run(args) -> exit code."""
