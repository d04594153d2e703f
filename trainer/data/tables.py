"""The rows of a table source: one string column (data.text_key) of a Parquet file, or of a Hugging Face
dataset folder written by `datasets`' save_to_disk (read with datasets.load_from_disk: memory-mapped Arrow
files, no network). pyarrow and datasets are imported only when such a source is read; without them, one
line says which package to install. Rows are numbered from 0, as pandas and datasets index them.
"""

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from parallel.errors import ConfigError

PARQUET_MAGIC = b"PAR1"
DATASET_FILES = ("dataset_info.json", "state.json")  # what save_to_disk writes beside the .arrow files
DATASET_DICT_FILE = "dataset_dict.json"  # a DatasetDict's folder: one dataset folder per split
_ROWS_PER_BATCH = 1024
_STRING_TYPES = ("string", "large_string", "string_view")
_SHOWN_COLUMNS = 10


def has_parquet_magic(path: Path) -> bool:
    """A Parquet file starts and ends with PAR1."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != PARQUET_MAGIC:
                return False
            f.seek(-4, 2)
            return f.read(4) == PARQUET_MAGIC
    except OSError:
        return False


def hf_dataset_layout(folder: Path) -> str | None:
    """"dataset" (a Dataset saved with save_to_disk), "dataset_dict" (a DatasetDict) or None."""
    if not folder.is_dir():
        return None
    if (folder / DATASET_DICT_FILE).is_file():
        return "dataset_dict"
    if all((folder / name).is_file() for name in DATASET_FILES) and _state_names_arrow_files(folder):
        return "dataset"
    return None


def _state_names_arrow_files(folder: Path) -> bool:
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and isinstance(state.get("_data_files"), list)


def _package(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"data.source: reading {what} needs the {name.split('.')[0]} package, which is not "
                          f"installed (pip install 'llm-trainer[data]'): {exc}") from exc


def _columns_line(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN_COLUMNS]) + (", ..." if len(names) > _SHOWN_COLUMNS else "")


def _check_column(where: str, key: str, names: list[str], type_name: str | None) -> None:
    if key not in names:
        raise ConfigError(f'{where} has no "{key}" column (its columns: {_columns_line(names) or "none"}); '
                          f"set data.text_key to the one holding the text")
    if type_name not in _STRING_TYPES and not _is_string_dictionary(type_name):
        raise ConfigError(f'{where}: its "{key}" column holds {type_name}, not strings; set data.text_key to '
                          f"the one holding the text")


def _is_string_dictionary(type_name: str | None) -> bool:
    """A dictionary-encoded string column (pandas' categorical text): its values are strings too."""
    return type_name is not None and type_name.startswith(tuple(f"dictionary<values={t}," for t in _STRING_TYPES))


def _column_texts(column) -> list[str | UnicodeDecodeError | None]:
    """A string column's values; a value that is not UTF-8 (its writer did not validate) comes as its decoding
    error, a bad record for the caller, where converting the column whole would fail without naming the row."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        binary = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}.get(column.type, pa.binary_view())
        return [value if value is None else _utf8_text(value) for value in column.cast(binary).to_pylist()]


def _utf8_text(value: bytes) -> str | UnicodeDecodeError:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc


def parquet_rows(path: Path, key: str) -> Iterator[tuple[int, str | UnicodeDecodeError | None]]:
    """(row number, the row's `key` string, why it is not UTF-8, or None for a null) of one Parquet file, in
    row order."""
    pa = _package("pyarrow", "Parquet files")
    parquet = _package("pyarrow.parquet", "Parquet files")
    where = f"data.source file {path}"
    try:
        table = parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{where} is not a readable Parquet file ({exc})") from exc
    schema = table.schema_arrow
    field = schema.field(key) if key in schema.names else None
    _check_column(where, key, schema.names, str(field.type) if field is not None else None)
    row = 0
    try:
        for batch in table.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[key]):
            for value in _column_texts(batch.column(0)):
                yield row, value
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{where} cannot be read past row {row} ({exc})") from exc


def dataset_rows(folder: Path, key: str) -> Iterator[tuple[int, str | UnicodeDecodeError | None]]:
    """(row number, the row's `key` string, why it is not UTF-8, or None, as parquet_rows) of a dataset
    folder written by save_to_disk."""
    datasets = _package("datasets", "Hugging Face dataset folders")
    where = f"data.source dataset {folder}"
    try:
        dataset = datasets.load_from_disk(str(folder))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where} cannot be read by datasets.load_from_disk ({exc})") from exc
    feature = dataset.features.get(key)
    _check_column(where, key, list(dataset.column_names), getattr(feature, "dtype", type(feature).__name__))
    row = 0
    for batch in dataset.select_columns([key]).with_format("arrow").iter(batch_size=_ROWS_PER_BATCH):
        for value in _column_texts(batch.column(0)):
            yield row, value
            row += 1
