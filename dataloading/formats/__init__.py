"""Sample formats: the sample schema and its fields, media kinds and decoding (video too), chat
templates and the tokenizer. The first of the sub-packages: it imports none of the others."""
