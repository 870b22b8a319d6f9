"""Workers' stderr, relayed to the console without the native (C++) stack traces that c10d and the backends print.

When a peer dies, every surviving rank's c10d layer logs a warning or error with a C++ backtrace (store reads that
find rank 0's store gone, a cut-off collective, NCCL's watchdog, `terminate called ...`), tens of lines each. Each
rank already prints paradiff's one line saying what failed, so those blocks are dropped and counted;
PARADIFF_DEBUG=1 relays everything unchanged.
"""

from __future__ import annotations

import re
import threading
from typing import BinaryIO, Callable

# A c10 log line ([rank1]:[W1130 13:00:01.722 TCPStore.cpp:125] ...) or the start of std::terminate's report.
_NATIVE_HEADER = re.compile(rb"^(\[rank\d+\]:)?\[[IWEF]\d{4} \d\d:\d\d:\d\d[.\d]* [^\]]*\] |^terminate called ")
# Lines that belong to a native backtrace.
_TRACE_LINE = re.compile(rb"^(Exception raised from |frame #\d+: |<omitting python frames>|\s+what\(\): |\s*$)")


class NativeTraceFilter:
    """Line filter: drops a native log line followed by a backtrace, together with the backtrace."""

    def __init__(self) -> None:
        self.dropped_traces = 0
        self._held: list[bytes] = []  # a native header, held until the next line shows whether a trace follows
        self._in_trace = False

    def feed(self, line: bytes) -> list[bytes]:
        """The lines to show now, given the next complete line (without its newline)."""
        if self._in_trace:
            if _TRACE_LINE.match(line):
                return []
            self._in_trace = False
        if self._held:
            if line.strip() and _TRACE_LINE.match(line):
                self._held = []
                self._in_trace = True
                self.dropped_traces += 1
                return []
            shown, self._held = self._held, []
            return shown + self.feed(line)
        if _NATIVE_HEADER.match(line):
            if line.startswith(b"terminate called "):
                self._in_trace = True
                self.dropped_traces += 1
                return []
            self._held = [line]
            return []
        return [line]

    def flush(self) -> list[bytes]:
        shown, self._held = self._held, []
        return shown


class StderrRelay:
    """Copies one worker's stderr pipe to `write` in a thread, line by line through a NativeTraceFilter.

    Progress bars (text after a carriage return, no newline yet) are passed on at once.
    """

    def __init__(self, pipe: BinaryIO, write: Callable[[bytes], None], filtered: bool = True) -> None:
        self.filter = NativeTraceFilter() if filtered else None
        self._pipe, self._write = pipe, write
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def dropped_traces(self) -> int:
        return self.filter.dropped_traces if self.filter else 0

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        pending = b""
        while True:
            chunk = self._pipe.read1(65536) if hasattr(self._pipe, "read1") else self._pipe.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            shown = [kept for line in lines for kept in (self.filter.feed(line) if self.filter else [line])]
            data = b"".join(line + b"\n" for line in shown)
            if b"\r" in pending:  # a progress bar's update: no newline comes until the bar is done
                data, pending = data + pending, b""
            self._write(data)
        rest = (self.filter.flush() if self.filter else []) + ([pending] if pending else [])
        self._write(b"".join(line + b"\n" for line in rest))
        self._pipe.close()
