"""Logging that names the role and the short peer id on every line."""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger(__name__)


def setup_logging(role: str, peer: str = "", level: int = logging.INFO) -> None:
    tag = f"{role} {peer}".strip()
    logging.basicConfig(
        level=level, force=True,
        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    log_uncaught_exceptions()
    drop_known_shutdown_lines()
    drop_identity_check_line()


class DropLines(logging.Filter):
    """Drops the records whose message holds every one of ``parts``; counts them in ``dropped``."""

    def __init__(self, *parts: str):
        super().__init__()
        self.parts, self.dropped = parts, 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if all(part in message for part in self.parts):
            self.dropped += 1
            return False
        return True


P2PD_LOGGER = "hivemind.p2p.p2p_daemon"  # hivemind logs what p2pd prints under this name, in the DHT's process
# p2pd's line when its control socket closes under its accept loop: it stops on a signal of its own (Ctrl-C in a
# terminal reaches every process of the terminal's process group, p2pd included). It says nothing else.
P2PD_SHUTDOWN_LINE = ("error accepting connection", "use of closed network connection")


def drop_known_shutdown_lines() -> None:
    """Keep p2pd's ``P2PD_SHUTDOWN_LINE`` (an ``[ERROR]`` line in hivemind's format) out of the terminal and the
    logs; every other line of p2pd passes. Set before the DHT's process starts: that process, which relays p2pd's
    lines, inherits the filter."""
    logger = logging.getLogger(P2PD_LOGGER)
    if not any(isinstance(f, DropLines) and f.parts == P2PD_SHUTDOWN_LINE for f in logger.filters):
        logger.addFilter(DropLines(*P2PD_SHUTDOWN_LINE))


# hivemind's line (its own format) before it checks that a peer's identity is free; it names the temporary copy of
# the identity the daemon reads. p2prl.net.transport says it in a line of its own, naming the user's file.
IDENTITY_CHECK_LINE = ("Checking that identity from", "is not used by other peers")


def drop_identity_check_line() -> None:
    """Keep hivemind's ``IDENTITY_CHECK_LINE`` out of the terminal and the logs (the DHT's process, which logs it,
    inherits the filter)."""
    logger = logging.getLogger(P2PD_LOGGER)
    if not any(isinstance(f, DropLines) and f.parts == IDENTITY_CHECK_LINE for f in logger.filters):
        logger.addFilter(DropLines(*IDENTITY_CHECK_LINE))


def log_uncaught_exceptions() -> None:
    """An uncaught exception's traceback (the main thread's or another's) goes through logging, so it lands in
    every log of this peer (a ``--log-file`` too, not only stderr); Ctrl-C keeps Python's own report."""

    def hook(kind, value, tb) -> None:
        if issubclass(kind, KeyboardInterrupt) or not logging.getLogger().handlers:
            sys.__excepthook__(kind, value, tb)
            return
        log.critical("uncaught %s: the peer stops", kind.__name__, exc_info=(kind, value, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if issubclass(args.exc_type, SystemExit) or not logging.getLogger().handlers:
            threading.__excepthook__(args)
            return
        name = args.thread.name if args.thread is not None else "?"
        log.error("uncaught %s in thread %s", args.exc_type.__name__, name,
                  exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    sys.excepthook, threading.excepthook = hook, thread_hook
