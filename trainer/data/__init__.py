"""Training data, in one direction: source files -> tokenizer -> packed token shards -> sampler -> loader.

A stage imports only the stages before it and gets what it needs as arguments. `build.build_data` is the
one entry the trainer calls; `prepare.py` builds the cache (tokenizer and packed tokens) once, on the
main rank, while the others wait (`cache.py`, `heartbeat.py`, `temp_dirs.py`)."""
