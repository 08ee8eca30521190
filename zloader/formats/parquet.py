"""Parquet files: one split per row group (``parallel_reads`` groups them).

Rows come as dicts ``{column: value}`` (Python values, as ``pyarrow``'s ``to_pylist``), or,
with ``batch_rows=n``, as column batches of up to ``n`` rows (never across row groups):
``{column: array}``, a numpy array for a column of numbers or booleans, a list for any
other type (strings, lists, structs). The row groups are counted from each file's footer
when the pipeline is built; row groups are read in the workers, streamed a batch at a
time. Needs pyarrow (``pip install 'zloader[formats]'``).

A footer pyarrow cannot parse is a corrupt file, reported at once (a
:class:`~zloader.errors.CodecError` naming it); only storage is retried (an URL's reads,
by :func:`~zloader.storage.open_file`), never the parsing of bytes already read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from zloader._defaults import PARQUET_READ_ROWS
from zloader.errors import CodecError
from zloader.formats.base import FormatSource
from zloader.storage import FileRef, StorageError, open_file

__all__ = ["ParquetSource", "count_row_groups"]


def _parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("from_parquet needs pyarrow: pip install 'zloader[formats]'") \
            from None
    return pq


def count_row_groups(files: Sequence[FileRef], storage_options: dict[str, Any] | None,
                     columns: Sequence[str] | None = None) -> tuple[int, ...]:
    """The number of row groups of each file, read from its footer, each file checked to
    hold ``columns`` (pyarrow would read a name it does not have as no column).

    Raises:
        CodecError: a footer is not Parquet's (a corrupt or truncated file); it names it.
        ValueError: a file lacks a column of ``columns``.
        StorageError: storage failed after its retries.
    """
    pq = _parquet()
    counts = []
    for path, size, _tag in files:
        with open_file(path, storage_options, size) as stream:
            try:
                footer = pq.ParquetFile(stream)
                counts.append(int(footer.num_row_groups))
            except StorageError:
                raise
            except (OSError, ValueError) as exc:  # pyarrow: ArrowIOError, ArrowInvalid
                raise CodecError(f"from_parquet: {path} is corrupt or not a Parquet file: "
                                 f"its footer cannot be read ({type(exc).__name__}: "
                                 f"{str(exc).strip()})") from None
            missing = _missing(footer, columns or ())
            if missing:
                raise ValueError(f"from_parquet: {path} has no column {missing} (its "
                                 f"columns: {footer.schema_arrow.names}); check columns=")
    return tuple(counts)


def _missing(footer: Any, columns: Sequence[str]) -> list[str]:
    """The names of ``columns`` that are neither a column of the file nor the path of a
    nested field in it (``"a.b"``, or ``"a"`` for all of a's fields)."""
    names = set(footer.schema_arrow.names)
    paths = [footer.schema.column(i).path for i in range(len(footer.schema))]
    return [name for name in columns if name not in names and not any(
        path == name or path.startswith(name + ".") for path in paths)]


def _columns(batch: Any) -> dict[str, Any]:
    import pyarrow as pa

    out: dict[str, Any] = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        kind = column.type
        if (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                or pa.types.is_boolean(kind)) and column.null_count == 0:
            out[name] = column.to_numpy(zero_copy_only=False)
        else:
            out[name] = column.to_pylist()
    return out


@dataclass(frozen=True, eq=False, kw_only=True)
class ParquetSource(FormatSource):
    """Rows (or column batches) of Parquet files; one unit per row group."""

    kind: ClassVar[str] = "from_parquet"
    row_groups: tuple[int, ...]
    columns: tuple[str, ...] | None
    batch_rows: int | None

    @property
    def units(self) -> Sequence[tuple[int, int]]:
        return [(file, group) for file, count in enumerate(self.row_groups)
                for group in range(count)]

    def unit_name(self, unit: Any) -> str:
        return f"file {self.files[unit[0]][0]}, row group {unit[1]}"

    def read_unit(self, unit: Any) -> Iterator[Any]:
        file, group = unit
        columns = list(self.columns) if self.columns is not None else None
        with self.open(file) as stream:
            reader = _parquet().ParquetFile(stream)
            for batch in reader.iter_batches(batch_size=self.batch_rows or PARQUET_READ_ROWS,
                                             row_groups=[group], columns=columns):
                if self.batch_rows is None:
                    yield from batch.to_pylist()
                else:
                    yield _columns(batch)

    def _format_options(self) -> tuple[Any, ...]:
        return (self.row_groups, self.columns, self.batch_rows)
