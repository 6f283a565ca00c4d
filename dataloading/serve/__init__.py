"""Serving steps to the trainer: the inline loader (DataLoader workers) and the Ray backend. The last of the sub-packages."""
