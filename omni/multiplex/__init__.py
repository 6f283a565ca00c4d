"""Encoder-LLM multiplexing at run time: the ``Multiplexer`` (``runtime``) that runs a step's
encoder calls at the pipeline's cuts and tail cuts, and the encoders' own FSDP module
(``media_tower``). What it runs is planned in ``omni.step`` (the multiplexing rules, the encoder
planner, the bubble selection and the step's calls), which the simulator reads too."""
