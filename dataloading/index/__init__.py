"""Where samples live and what the planner knows of them: sources (folders, globs, URLs), shards and their readers, the metadata index. Imports only ``formats``."""
