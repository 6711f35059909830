"""`elsi-fast` command line: one module per subcommand, each with a `register(subparsers)`.

A run goes: parse -> `check(args)` (validates every argument that can be validated without torch,
creates nothing) -> choose threads (elsi_fast._infra.threads, before torch is imported) -> `func(args)`.
Parsing, `--help` and argument errors import neither torch, transformers nor triton. A user error
is one line `elsi-fast CMD: error: --ARG: problem; fix` and exit code 2; Ctrl-C ends with a
line saying how to continue (`interrupted(args)`) and exit code 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMAND_MODULES = ("analyze", "regenerate", "draft", "serve", "generate", "demo", "experiment")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A bad argument, found before any work; the message names the argument and the fix."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): the message already names the argument."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_lookup_args(args) -> None:
    """--lookup-k only with --prompt-lookup (eval-draft, generate)."""
    if args.lookup_k is not None and args.prompt_lookup is None:
        raise UsageError("--lookup-k: sets how long prompt-lookup proposals are; give --prompt-lookup N too")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="elsi-fast",
        description="Choose EAGLE3 draft layers by hidden-state entropy and CKA; train and run drafts.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(f"elsi_fast.cli.{name}").register(sub)
    for command in sub.choices.values():
        command.add_argument(
            "--threads", type=positive_int, default=None,
            help="CPU threads (default: the cores available to this process that other jobs leave free, "
            "or $OMP_NUM_THREADS; idle threads sleep instead of spinning)",
        )
    return parser


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _join_torchrun() -> None:
    """Under torchrun (WORLD_SIZE > 1) join its process group: gloo on the CPU, NCCL on GPUs."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argparse error (2), already printed
        return int(exc.code or 0)
    try:
        check = getattr(args, "check", None)
        if check is not None:
            check(args)
        from .._infra.threads import configure

        args.threads = configure(args.threads)
        _join_torchrun()
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, FileExistsError) as exc:
        print(f"elsi-fast {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        hint = getattr(args, "interrupted", None)
        print(f"\nelsi-fast {args.command}: interrupted" + (f"; {hint(args)}" if hint else ""), file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
