"""Constructing the planned steps: samples fetched, tokenized and packed into the batch types
(with M-RoPE positions; CP slicing), the held-out sets, a step's job. It imports ``formats``,
``index`` and ``plan``."""
