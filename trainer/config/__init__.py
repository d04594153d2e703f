"""The run's configuration: the typed schema (`schema.py`), the static rules every rank checks before any
process group exists (`rules.py`), those that need the tokenizer (`vocab.py`: the model's vocabulary), and
the command line's override check, which imports no torch so that launchers run it in about a second
(`cli.py`)."""
