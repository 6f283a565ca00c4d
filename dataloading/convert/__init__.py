"""``omni data convert``: other datasets' records -> conversations -> shards, then indexed. Imports ``formats`` and ``index``."""
