"""Encoder-LLM multiplexing in one room: the pure rules (``rules``: placements, action lists,
weight groups and reduction timing), the encoder planner (``planning``: which rank encodes which
item, long-short split, routes), the runtime that executes a step's encoder work at the
pipeline's cuts (``runtime``) and the encoders' own module (``media_tower``). The simulator
(``omni.sim``) imports ``rules`` and ``planning`` only."""
