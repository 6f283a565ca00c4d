"""Where samples live and what the planner knows of them: sources (folders, globs, URLs), shards
and their readers, the metadata index. Of the other sub-packages it imports only ``formats``."""
