"""`elsi-fast` command line: one module per subcommand, each with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules import their heavy dependencies inside their handlers, so `--help` is fast.
_SUBCOMMAND_MODULES = ("analyze", "draft", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elsi-fast",
        description="Choose EAGLE3 draft layers by hidden-state entropy and CKA; train and run drafts.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(f"elsi_fast.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"elsi-fast {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
