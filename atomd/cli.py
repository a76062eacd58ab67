"""`atomd` command line: one subcommand per module, imported lazily.

Each module named below exposes `add_arguments(parser)` and `run(args) -> int`,
so `atomd --help` stays fast (no torch import) and every module owns its flags.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("atomd.api.serve", "start an OpenAI-compatible engine server"),
    "generate": ("atomd.generate", "offline generation for a prompt"),
    "run-batch": ("atomd.api.run_batch", "answer an OpenAI batch file (JSON lines) with an in-process engine"),
    "bench": ("atomd.bench.cli", "serving benchmarks (bench serve | bench compare)"),
    "profile": ("atomd.sim.profile", "time the real engine's steps, fit a simulated-hardware profile"),
    "plan": ("atomd.sim.plan", "pick a prefill:decode layout by simulation, write Ray / Helm configs"),
    "make-default-model": ("atomd.model.default", "write the built-in default checkpoint"),
}


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose errors are one line naming the flag (argparse prints the whole usage
    first: 50 lines for `atomd serve`); --help still shows it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="atomd")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd_parser = OneLineErrors(prog=f"atomd {argv[0]}")
    module.add_arguments(cmd_parser)
    cmd_parser.add_argument("--debug", action="store_true",
                            help="log at debug level and show the traceback of a start-up error")
    args = cmd_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except OSError as e:  # a file the user named is missing or unreadable: theirs to fix, one line
        if args.debug or e.filename is None:
            raise
        print(f"atomd {argv[0]}: error: {e.filename}: {e.strerror or e} (--debug shows where)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
