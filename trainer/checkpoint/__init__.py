"""Checkpoints: the files of a save and their manifest (`files.py`), what a checkpoint holds (`state.py`),
DCP's reads and writes (`dcp_io.py`), saves in the background (`async_save.py`), which checkpoint a
run continues and whether it may (`resume.py`, `fingerprint.py`), and weights from a Hugging Face
folder (`hf_import.py`)."""
