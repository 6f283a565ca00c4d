"""Sample formats: the sample schema and its fields, media kinds and decoding (video too), chat templates and the tokenizer. Imports nothing from the other sub-packages."""
