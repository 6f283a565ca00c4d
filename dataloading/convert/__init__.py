"""``omni data convert``: other datasets' records -> conversations -> shards, then indexed. Of the
other sub-packages it imports ``formats`` and ``index``."""
