"""A progress bar on stderr: tqdm when it is installed, otherwise plain status lines."""

from __future__ import annotations

import sys
from typing import Optional

try:
    from tqdm import tqdm
except ImportError:  # the [bench] extra is absent: plain status lines
    tqdm = None


class Progress:
    def __init__(self, total: int, *, enabled: bool = True, desc: str = "ttftc bench"):
        self.enabled = enabled
        self._bar = None
        if enabled and tqdm is not None:
            self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True, leave=False)

    def step(self, what: Optional[str] = None, n: int = 1) -> None:
        if self._bar is not None:
            if what:
                self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(n)

    def add_total(self, n: int) -> None:
        if self._bar is not None:
            self._bar.total += n
            self._bar.refresh()

    def note(self, text: str) -> None:
        """A status line that does not garble the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
