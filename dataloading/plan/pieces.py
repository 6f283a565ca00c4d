"""How a piece of a sample split over the token budget is named: ``"<source>/<key>#<k>"`` is piece k.
One home for the rule the planner writes and the constructor and the Ray actors read (its own
module, so that none of them imports another for it)."""
from __future__ import annotations

PIECE_SEP = "#"  # "<source>/<key>#<k>": piece k of a sample split over the budget


def split_piece(unit_id: str) -> tuple[str, int | None]:
    """``"src/key#2"`` -> ("src/key", 2); a whole sample -> (id, None)."""
    sid, sep, k = unit_id.rpartition(PIECE_SEP)
    if sep and k.isdigit() and "/" in sid:
        return sid, int(k)
    return unit_id, None
