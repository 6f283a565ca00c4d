"""Serving steps to the trainer: the inline loader (DataLoader workers) and the Ray backend, and
what both keep between steps. The last of the sub-packages: it may import any other."""
