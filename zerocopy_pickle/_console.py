"""Internal: console output for the command line and the demo, never for the library.

Two things a program with a terminal decides and a library must not: where the ``zerocopy_pickle`` log records go
(:func:`configure_logging`), and which third-party messages are noise to the person reading that terminal
(:func:`quiet_third_party`). And one thing every line for a terminal needs: text that came from a file, shown so
that it cannot drive the terminal (:func:`printable`). ``zerocopy_pickle._cli`` and the demo call them; the
library's dump and load paths never import this module (a library that configures logging or swallows other
libraries' warnings takes that choice away from the application it runs in).
"""

from __future__ import annotations

import logging
import re
import sys

LOGGER_NAME = "zerocopy_pickle"
_HANDLER_NAME = "zerocopy_pickle._console"

# The third-party messages the demo and the CLI drop: (logger name, regular expression matched at the start of the
# message). Each is matched exactly, on the logger that emits it, so anything else those libraries say still reaches
# the terminal.
NOISE: tuple[tuple[str, str], ...] = (
    # bitsandbytes, at import on a CPU with AVX512-BF16 and without the optional `kernels` package: it falls back
    # to its own kernel, which works; nothing this project does needs the faster one.
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community: "),
    # transformers, when diffusers looks up CLIPImageProcessor (or another image processor) without torchvision:
    # it falls back to the PIL implementation, which the demo's pipelines (no feature extractor) never use.
    (
        "transformers.utils.import_utils",
        r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to ",
    ),
)


_NAMED_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def printable(text: str, *, keep: str = "") -> str:
    """``text`` with every character that is not printable written as a visible escape, so that a string from a
    file cannot move the cursor, retitle the window, ring the bell, rewrite what was printed before it, or
    reorder what follows it.

    Escaped: control characters (C0, DEL, and C1 such as the one-byte CSI ``\\x9b``: ESC is ``\\x1b``), format
    characters (the bidirectional overrides and isolates U+202A-U+202E and U+2066-U+2069, zero-width characters),
    line and paragraph separators, spaces other than the plain space, surrogates and unassigned code points: every
    character for which :meth:`str.isprintable` is false, in Python's escape syntax (``\\n``, ``\\x1b``,
    ``\\u202e``, ``\\U000e0001``). A backslash is doubled, so an escape in the output always means the character
    it names. ``keep``: characters to leave as they are (a log record keeps its line breaks).
    """
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(ch if ch in keep else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    named = _NAMED_ESCAPES.get(ch)
    if named is not None:
        return named
    if ch.isprintable():
        return ch
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


class _PrintableFormatter(logging.Formatter):
    """A formatter whose message part is :func:`printable` (line breaks kept): a log record can quote a string
    from a file."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message, keep="\n")
        return super().formatMessage(record)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as :data:`logging.lastResort` does), so a
    handler installed once keeps following a redirected or captured stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # emit runs under the handler's lock
        super().emit(record)


def configure_logging(verbosity: int) -> None:
    """Send the ``zerocopy_pickle`` log records to stderr, at the level a command line's ``-q``/``-v`` chose.

    Args:
        verbosity: ``-1`` (quiet): errors only; ``0``: warnings; ``1``: also INFO (what was written, loaded,
            served); ``2`` or more: also DEBUG.

    The handler goes on the ``zerocopy_pickle`` logger, not the root logger, so other libraries' records are
    not affected. Calling it again changes the level and keeps the one handler.
    """
    if verbosity < 0:
        level = logging.ERROR
    else:
        level = (logging.WARNING, logging.INFO)[verbosity] if verbosity < 2 else logging.DEBUG
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not any(handler.get_name() == _HANDLER_NAME for handler in logger.handlers):
        handler = _StderrHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(_PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


class _DropMessages(logging.Filter):
    """Drops the records whose message matches one of ``patterns`` at its start."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(pattern) for pattern in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.match(message) for pattern in self.patterns)


def quiet_third_party() -> None:
    """Drop the known third-party noise (:data:`NOISE`) from this process's output.

    The filters go on the emitting loggers by name, which works whether or not the library that logs there has
    been imported yet (bitsandbytes logs its message while it is being imported). Child processes do not
    inherit them: their entry points call this too (the demo's scenario runs, ``python -m
    zerocopy_pickle.cache``). Idempotent. Never called by the library.
    """
    by_logger: dict[str, list[str]] = {}
    for name, prefix in NOISE:
        by_logger.setdefault(name, []).append(prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))
