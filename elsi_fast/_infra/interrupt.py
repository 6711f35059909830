"""Ctrl-C that lets a long run save its state first.

A KeyboardInterrupt raised in the middle of a batch or an optimizer step leaves the accumulators
half-updated, so the state that could be saved then is not one a resumed run may continue from.
`DeferredInterrupt` holds the first Ctrl-C until the loop reaches a point where the state is
whole; the loop saves and raises KeyboardInterrupt there. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal
import sys
import threading


class DeferredInterrupt:
    """Context manager: SIGINT inside the block sets `requested` instead of raising.

    with DeferredInterrupt("the pass", enabled=state_path is not None) as interrupt:
        for batch in batches:
            work(batch)
            if interrupt.requested or due:
                save()
            interrupt.raise_if_requested()

    Does nothing (Ctrl-C raises as usual) when not enabled, outside the main thread, or when
    someone else has replaced Python's default SIGINT handler.
    """

    def __init__(self, what: str, *, enabled: bool = True):
        self.what = what
        self.enabled = enabled
        self.requested = False
        self._previous = None

    def __enter__(self) -> "DeferredInterrupt":
        self.requested = False
        if (
            self.enabled
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\ninterrupt: saving {self.what} once the current step ends (Ctrl-C again to stop without saving)",
              file=sys.stderr, flush=True)

    def raise_if_requested(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C came (call after saving)."""
        if self.requested:
            raise KeyboardInterrupt
