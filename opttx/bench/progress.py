"""The training progress bar: ``tqdm`` when installed, otherwise a plain stderr bar."""

from __future__ import annotations

import sys
import time

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional
    tqdm = None


class ProgressBar:
    """Show training progress and the latest loss (of the optimizer that made it)."""

    _WIDTH = 30
    _MIN_INTERVAL_S = 0.1

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total = total
        self.desc = desc
        self.count = 0
        self.enabled = enabled     # False: count silently (the other ranks of a torchrun job)
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._tqdm = (tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
                      if tqdm and enabled else None)

    def advance(self, loss: float, label: str = "") -> None:
        """Record one finished step with training loss ``loss`` (of optimizer ``label``)."""
        self.count += 1
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(f"{label} loss {loss:.4f}".strip(), refresh=False)
            self._tqdm.update(1)
            return
        now = time.perf_counter()
        if now - self._last_draw >= self._MIN_INTERVAL_S or self.count == self.total:
            self._last_draw = now
            self._draw(loss, label, now - self._start)

    def _draw(self, loss: float, label: str, elapsed: float) -> None:
        filled = self._WIDTH * self.count // max(self.total, 1)
        rate = self.count / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "-" * (self._WIDTH - filled)
        sys.stderr.write(
            f"\r{self.desc} [{bar}] {self.count}/{self.total} {label} loss {loss:.4f} "
            f"{rate:.1f} it/s {elapsed:.0f}s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        """Finish the bar, leaving it on screen."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()
