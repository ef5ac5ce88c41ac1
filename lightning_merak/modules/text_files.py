"""Documents of a local ``.txt`` file (one document) or ``.jsonl`` file (one JSON object per line, the text, or a
list of token ids, under a field), read with refusals that name the file, the line and the fix."""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_merak.modules.config import DataError

__all__ = ["TEXT_SUFFIXES", "DataFileNotFound", "MissingTextField", "checked_token_ids", "load_text_documents",
           "not_utf8"]

TEXT_SUFFIXES = (".txt", ".jsonl")


class DataFileNotFound(DataError, FileNotFoundError):
    """A data or tokenizer path that does not exist: a :class:`DataError` (``merak-train`` prints it as a refusal)
    that Python callers may still catch as the ``FileNotFoundError`` it is."""


class MissingTextField(DataError, KeyError):
    """A ``.jsonl`` record without the text field: a :class:`DataError` (``merak-train`` prints it as a refusal)
    that Python callers may still catch as a ``KeyError``; shown as its message, not quoted as a ``KeyError`` is."""

    __str__ = DataError.__str__


_REENCODE_FIX = "re-encode the file as UTF-8 (e.g. iconv -f <its encoding> -t utf-8)"


def not_utf8(file: Path, path: str) -> Optional[DataError]:
    """The refusal of a file that does not decode as UTF-8, naming its first line that does not; None if it decodes.

    Read a line at a time, so a large corpus is never held whole: no UTF-8 character spans a newline byte."""
    with file.open("rb") as lines:
        for line_number, line in enumerate(lines, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return DataError(f"{path}:{line_number} is not UTF-8 text (byte 0x{line[error.start]:02x} at column "
                                 f"{error.start + 1}: {error.reason}); {_REENCODE_FIX}")
    return None


def checked_token_ids(ids: Sequence[Any], vocab_size: int, where: str) -> list[int]:
    """``ids`` (a pre-tokenised document) as a list of ints, refused unless each is an integer id of the model's
    vocabulary: past it the embedding fails only after launch (on a GPU as a device assert), and a float or negative
    id would be truncated or read from the table's end. ``where`` names the document in the error (file and line)."""
    token_ids = list(ids)
    if not token_ids or (set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return token_ids  # the common case, checked without a Python step per id
    for position, value in enumerate(token_ids):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise DataError(f"{where} holds {value!r} at position {position}, not an integer token id; write the "
                            "document's token ids as integers, or fix or drop that document")
        if not 0 <= value < vocab_size:
            raise DataError(f"{where} holds token id {value} at position {position}, outside the vocabulary of "
                            f"{vocab_size} tokens (ids 0 to {vocab_size - 1}); set data.tokenizer_path to the "
                            "tokenizer that made these ids (the model's vocab_size is that tokenizer's), or fix that "
                            "document's ids")
    return [int(value) for value in token_ids]  # numpy integers, say, as Python ints


def _jsonl_documents(file: Path, path: str, text_field: str, vocab_size: int) -> list[Any]:
    """Each line's ``text_field``: text, or a list of token ids of a ``vocab_size`` vocabulary in a tokenised file."""
    documents = []
    one_object = f"each line of a .jsonl file must be one JSON object, such as {{\"{text_field}\": \"...\"}}"
    with file.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number} is not valid JSON ({error.msg} at column {error.colno}); "
                                f"{one_object}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_number} is a JSON {type(record).__name__}, not an object; {one_object}")
            if text_field not in record:
                raise MissingTextField(
                    f"{path}:{line_number} has no field {text_field!r} (fields: {sorted(record)}); "
                    "set data.text_field to the field holding the text"
                )
            value = record[text_field]
            if isinstance(value, list):
                value = checked_token_ids(value, vocab_size, f"{path}:{line_number} field {text_field!r}")
            elif not isinstance(value, str):
                raise DataError(f"{path}:{line_number} field {text_field!r} holds {json.dumps(value)[:40]}, neither "
                                "text nor a list of token ids; fix or drop that line")
            documents.append(value)
    return documents


def load_text_documents(path: str, text_field: str, vocab_size: int) -> list[Any]:
    """Read the documents of a ``.txt`` or ``.jsonl`` file, with errors that name the file, the line and the fix
    (token ids outside the tokenizer's ``vocab_size`` among them)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataFileNotFound(
            f"data.path={path!r} does not exist; pass an existing .txt or .jsonl file "
            "(e.g. data=text data.path=/abs/path/corpus.txt)"
        )
    if file.suffix not in TEXT_SUFFIXES:
        raise ValueError(
            f"data.path={path!r} has suffix {file.suffix!r}; supported are {', '.join(TEXT_SUFFIXES)}"
        )
    try:
        if file.suffix == ".txt":
            return [file.read_text(encoding="utf-8")]
        return _jsonl_documents(file, path, text_field, vocab_size)
    except UnicodeDecodeError:  # read again as bytes only now, to find the line (none: changed since)
        raise (not_utf8(file, path) or DataError(f"{path} is not UTF-8 text; {_REENCODE_FIX}")) from None
