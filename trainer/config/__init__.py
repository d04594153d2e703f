"""The run's configuration: the typed schema (`schema.py`), the static rules every rank checks before any
process group exists (`rules.py`), and the command line's override check, which imports no torch so
that launchers run it in about a second (`cli.py`)."""
