"""`omni plugins`: list registered plugins, one per line, with where each comes from."""
from __future__ import annotations


def plugins_main() -> int:
    from omni.models.encoders.registry import available_encoders

    for name, origin in sorted(available_encoders().items()):
        print(f"encoder  {name:<16} {origin}")
    return 0
