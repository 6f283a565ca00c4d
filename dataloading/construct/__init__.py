"""Constructing the planned steps: samples fetched, tokenized and packed into the batch types (M-RoPE positions, CP slicing), the held-out sets, a step's job. Imports the packages before it."""
