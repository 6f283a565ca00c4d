"""Warnings said once. The simulator runs training's layout checks for every placement, chunk
count and (``omni plan``) candidate layout, and a check that warns (``omni: warning: tp x cp =
16 spans nodes ...``) would repeat its line each time: 63 times inside ``omni plan``'s progress
bar. ``Warnings`` takes those lines off stderr while the simulator runs and gives each back
once, with how many layouts raised it; any other stderr line passes through."""
from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Hashable, Iterator

PREFIX = "omni: warning:"
_NUMBER = re.compile(r"\d+")


class Warnings:
    def __init__(self) -> None:
        # template (numbers as #) -> (the numbers of each variant seen, the layouts that raised it)
        self._seen: dict[str, tuple[list[list[str]], set[Hashable]]] = {}

    @contextlib.contextmanager
    def of(self, layout: Hashable) -> Iterator[None]:
        """Collect the warnings printed inside, as raised by ``layout``."""
        buf = io.StringIO()
        try:
            with contextlib.redirect_stderr(buf):
                yield
        finally:
            for line in buf.getvalue().splitlines():
                if line.startswith(PREFIX):
                    variants, layouts = self._seen.setdefault(_NUMBER.sub("#", line), ([], set()))
                    variants.append(_NUMBER.findall(line))
                    layouts.add(layout)
                else:
                    print(line, file=sys.stderr)

    def lines(self, what: str) -> list[str]:
        """Each warning once: its numbers where the variants differ joined by "/" (tp x cp =
        16/32), then how many of ``what`` raised it."""
        out = []
        for template, (variants, layouts) in self._seen.items():
            slots = [sorted(set(values), key=int) for values in zip(*variants)]
            parts = template.split("#")
            text = parts[0] + "".join("/".join(v) + p for v, p in zip(slots, parts[1:]))
            out.append(f"{text} ({len(layouts)} {what})")
        return out
