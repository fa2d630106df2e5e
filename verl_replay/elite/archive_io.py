"""Frozen-archive file: a parquet table of elites plus a JSON manifest.

Layout for ``path = "archive.parquet"``:

* ``archive.parquet`` -- one row per elite, sorted by (question_id, approach, descriptor),
  columns :data:`COLUMNS`; JSON-valued fields (prompt/messages, ground truth, metadata) are
  stored as canonical JSON strings so the schema does not depend on the dataset.
* ``archive.parquet.manifest.json`` -- provenance and the ``content_sha256`` of the parquet
  file's bytes; keys: :data:`REQUIRED_MANIFEST_KEYS` from the caller, ``vocabulary``,
  ``search_config``, ``counts`` (all denominators), ``coverage`` (when saved from an
  :class:`EliteArchive`), plus the writer's :data:`WRITER_MANIFEST_KEYS`. Extra caller keys
  are kept.

Both files are written atomically (temp file in the same directory, fsync, ``os.replace``),
data first, manifest last: the manifest is the commit point, so a crash in between leaves a
manifest whose hash no longer matches and :func:`load_frozen_archive` refuses the pair.

Loading checks, in order: manifest format/version, the content hash (a flipped byte or a
truncated file is refused with both hashes named), the tokenizer fingerprint and the dataset
(when the caller states what it expects), emptiness (refused unless ``allow_empty=True``),
and the table's schema and row count.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from verl_replay._files import default_file_mode
from verl_replay.elite.archive import (
    Elite,
    EliteArchive,
    FrozenArchive,
    FrozenEntry,
    Question,
    thaw_json,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "COLUMNS",
    "REQUIRED_MANIFEST_KEYS",
    "WRITER_MANIFEST_KEYS",
    "ArchiveFileError",
    "ArchiveIntegrityError",
    "TokenizerMismatchError",
    "DatasetMismatchError",
    "EmptyArchiveError",
    "FrozenArchive",
    "FrozenEntry",
    "manifest_path",
    "manifest_dict",
    "tokenizer_fingerprint",
    "save_frozen_archive",
    "load_frozen_archive",
]

FORMAT = "verl_replay.elite_archive"
FORMAT_VERSION = 1

_SCHEMA = pa.schema(
    [
        pa.field("question_id", pa.string(), nullable=False),
        pa.field("approach", pa.string(), nullable=False),
        pa.field("descriptor", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("num_tokens", pa.int64(), nullable=False),
        pa.field("requested_approach", pa.string(), nullable=True),  # null for seed samples
        pa.field("parent_approach", pa.string(), nullable=True),  # null when no parent
        pa.field("parent_descriptor", pa.string(), nullable=True),
        pa.field("insertion_round", pa.int64(), nullable=False),
        pa.field("verification_reason", pa.string(), nullable=False),
        pa.field("prompt_json", pa.string(), nullable=False),  # str or chat messages, as JSON
        pa.field("ground_truth_json", pa.string(), nullable=False),
        pa.field("question_metadata_json", pa.string(), nullable=False),
        pa.field("generation_metadata_json", pa.string(), nullable=False),
    ]
)
COLUMNS: tuple[str, ...] = tuple(_SCHEMA.names)

# what the caller must state: base model, tokenizer; the dataset for the refusal check
REQUIRED_MANIFEST_KEYS: tuple[str, ...] = ("base_model", "tokenizer_name", "tokenizer_fingerprint", "dataset")
# what the writer computes; a caller may not set these
WRITER_MANIFEST_KEYS: tuple[str, ...] = (
    "format",
    "format_version",
    "created_at",
    "data_file",
    "columns",
    "num_entries",
    "num_questions",
    "content_sha256",
)


class ArchiveFileError(ValueError):
    """A frozen-archive file that cannot be used."""


class ArchiveIntegrityError(ArchiveFileError):
    """The data file's bytes do not match the manifest's content hash."""


class TokenizerMismatchError(ArchiveFileError):
    """The archive was built for a different tokenizer."""


class DatasetMismatchError(ArchiveFileError):
    """The archive was built from a different dataset."""


class EmptyArchiveError(ArchiveFileError):
    """The archive holds no entries (refused for training unless ``allow_empty``)."""


def manifest_path(path: str | os.PathLike[str]) -> Path:
    """``<path>.manifest.json``."""
    p = Path(path)
    return p.with_name(p.name + ".manifest.json")


def _canonical_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from None


def tokenizer_fingerprint(
    vocab: Mapping[str, int],
    special_tokens: Mapping[str, Any] | Sequence[str] | None = None,
    chat_template: str | None = None,
) -> str:
    """sha256 (hex) of a canonical JSON of the tokenizer's vocabulary, special tokens and chat
    template. Pure: the caller extracts these (e.g. ``tok.get_vocab()``,
    ``tok.special_tokens_map``, ``tok.chat_template``). A sequence of special tokens is treated
    as a set (sorted); a mapping keeps its values as given (keys sorted).
    """
    pairs = []
    for token, idx in vocab.items():
        if not isinstance(token, str) or isinstance(idx, bool) or not isinstance(idx, int):
            raise TypeError(f"vocab maps str -> int, got {token!r} -> {idx!r}")
        pairs.append([idx, token])
    pairs.sort()
    if special_tokens is None or isinstance(special_tokens, Mapping):
        specials: Any = None if special_tokens is None else dict(special_tokens)
    elif isinstance(special_tokens, str):
        raise TypeError("special_tokens is a mapping or a sequence of strings, not a single string")
    else:
        specials = sorted(special_tokens)
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a str or None, got {type(chat_template).__name__}")
    payload = {"vocab": pairs, "special_tokens": specials, "chat_template": chat_template}
    return hashlib.sha256(_canonical_json(payload, "tokenizer description").encode("ascii")).hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    os.fchmod(fd, default_file_mode())  # mkstemp makes 0600; the archive is shared like any output
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable; not every platform lets us open a directory
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _rows(entries: Sequence[FrozenEntry]) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for e in entries:
        d = e.to_dict()
        where = f"question {e.question_id!r} cell {(e.approach, e.descriptor)}"
        cols["question_id"].append(e.question_id)
        cols["approach"].append(e.approach)
        cols["descriptor"].append(e.descriptor)
        cols["text"].append(e.text)
        cols["num_tokens"].append(e.num_tokens)
        cols["requested_approach"].append(e.requested_approach)
        cols["parent_approach"].append(None if e.parent is None else e.parent.approach)
        cols["parent_descriptor"].append(None if e.parent is None else e.parent.descriptor)
        cols["insertion_round"].append(e.insertion_round)
        cols["verification_reason"].append(e.verification_reason)
        cols["prompt_json"].append(_canonical_json(d["prompt"], f"prompt of {where}"))
        cols["ground_truth_json"].append(_canonical_json(d["ground_truth"], f"ground truth of {where}"))
        cols["question_metadata_json"].append(_canonical_json(d["question_metadata"], f"question metadata of {where}"))
        cols["generation_metadata_json"].append(
            _canonical_json(d["generation_metadata"], f"generation metadata of {where}")
        )
    return cols


def save_frozen_archive(
    archive_or_elites: EliteArchive | Iterable[Elite],
    path: str | os.PathLike[str],
    *,
    manifest: Mapping[str, Any],
    questions: Mapping[str, Question] | Iterable[Question] | None = None,
) -> dict[str, Any]:
    """Write the parquet file and its manifest atomically; return the manifest written.

    ``manifest`` must hold :data:`REQUIRED_MANIFEST_KEYS`; ``search_config`` defaults to ``{}``.
    From an :class:`EliteArchive`, ``vocabulary``, ``counts`` and ``coverage`` come from the
    archive. From an iterable of :class:`Elite`, pass ``questions`` (their prompts and ground
    truths go into the file) and put ``vocabulary`` and ``counts`` in ``manifest``.
    """
    path = Path(path)
    man = dict(manifest)
    missing = [k for k in REQUIRED_MANIFEST_KEYS if k not in man]
    if missing:
        raise ValueError(
            f"save_frozen_archive: manifest is missing {missing} (required: {list(REQUIRED_MANIFEST_KEYS)})"
        )
    reserved = sorted(set(man) & set(WRITER_MANIFEST_KEYS))
    if reserved:
        raise ValueError(f"save_frozen_archive: manifest keys {reserved} are computed by the writer; remove them")
    fp = man["tokenizer_fingerprint"]
    if not isinstance(fp, str) or not fp:
        raise ValueError("save_frozen_archive: manifest['tokenizer_fingerprint'] must be a non-empty str")
    man.setdefault("search_config", {})

    if isinstance(archive_or_elites, EliteArchive):
        archive = archive_or_elites
        if questions is not None:
            raise ValueError("save_frozen_archive: questions= is only for an iterable of elites")
        vocab = list(archive.approaches)
        if "vocabulary" in man and list(man["vocabulary"]) != vocab:
            raise ValueError(f"manifest['vocabulary'] {man['vocabulary']} differs from the archive's {vocab}")
        for key in ("counts", "coverage"):
            if key in man:
                raise ValueError(f"save_frozen_archive: manifest[{key!r}] comes from the archive; remove it")
        man["vocabulary"] = vocab
        man["counts"] = archive.counts()
        man["coverage"] = archive.coverage()
        frozen = archive.freeze()
    else:
        for key in ("vocabulary", "counts"):
            if key not in man:
                raise ValueError(f"save_frozen_archive: saving bare elites needs manifest[{key!r}]")
        if questions is None:
            raise ValueError("save_frozen_archive: saving bare elites needs questions= (prompts, ground truths)")
        by_id = dict(questions) if isinstance(questions, Mapping) else {q.id: q for q in questions}
        entries = []
        for elite in archive_or_elites:
            if elite.question_id not in by_id:
                raise ValueError(f"save_frozen_archive: no question given for elite of {elite.question_id!r}")
            entries.append(FrozenEntry.from_elite(elite, by_id[elite.question_id]))
        frozen = FrozenArchive(entries)
        vocab = list(man["vocabulary"])
        man["vocabulary"] = vocab
    outside = sorted({e.approach for e in frozen} - set(vocab))
    if outside:
        raise ValueError(f"save_frozen_archive: entries use approaches {outside} outside the vocabulary {vocab}")

    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pydict(_rows(frozen.entries), schema=_SCHEMA), sink)
    data = sink.getvalue().to_pybytes()

    man.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        data_file=path.name,
        columns=list(COLUMNS),
        num_entries=len(frozen),
        num_questions=frozen.num_questions,
        content_sha256=hashlib.sha256(data).hexdigest(),
    )
    text = json.dumps(man, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False)  # validates JSON-ness
    _atomic_write_bytes(path, data)
    _atomic_write_bytes(manifest_path(path), text.encode("ascii"))
    return man


def _read_manifest(path: Path) -> dict[str, Any]:
    mpath = manifest_path(path)
    if not mpath.exists():
        raise FileNotFoundError(f"frozen archive manifest {mpath} not found (expected next to {path})")
    try:
        man = json.loads(mpath.read_text(encoding="ascii"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchiveFileError(f"{mpath}: manifest is not valid JSON ({exc})") from None
    if not isinstance(man, dict):
        raise ArchiveFileError(f"{mpath}: manifest is not a JSON object")
    if man.get("format") != FORMAT:
        raise ArchiveFileError(f"{mpath}: not a frozen-archive manifest (format {man.get('format')!r})")
    if man.get("format_version") != FORMAT_VERSION:
        raise ArchiveFileError(
            f"{mpath}: format version {man.get('format_version')!r}; this code reads version {FORMAT_VERSION}"
        )
    return man


def _same_json(a: Any, b: Any) -> bool:
    return _canonical_json(a, "dataset") == _canonical_json(b, "dataset")


def load_frozen_archive(
    path: str | os.PathLike[str],
    *,
    expected_tokenizer_fingerprint: str | None = None,
    expected_dataset: Any = None,
    allow_empty: bool = False,
) -> FrozenArchive:
    """Load and check a frozen archive (see the module docstring for the checks).

    ``expected_tokenizer_fingerprint`` / ``expected_dataset``: when given, a manifest that
    disagrees is refused. Training code should always pass the fingerprint of its tokenizer.
    """
    path = Path(path)
    man = _read_manifest(path)
    if not path.exists():
        raise FileNotFoundError(f"frozen archive data file {path} not found (its manifest exists)")
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    expected = man.get("content_sha256")
    if actual != expected:
        raise ArchiveIntegrityError(
            f"{path}: content hash mismatch -- manifest {manifest_path(path).name} says sha256 {expected}, "
            f"the file ({len(data)} bytes) has sha256 {actual}; the file is corrupted, truncated or was "
            f"replaced without its manifest. Restore the file with its manifest, or build the archive again: "
            f"python -m verl_replay.elite.search ... --out {path} (--tiny for the tiny task)"
        )
    built_fp = man.get("tokenizer_fingerprint")
    if expected_tokenizer_fingerprint is not None and built_fp != expected_tokenizer_fingerprint:
        raise TokenizerMismatchError(
            f"{path}: archive was built with tokenizer {man.get('tokenizer_name')!r} (fingerprint "
            f"{built_fp}), but the training tokenizer has fingerprint "
            f"{expected_tokenizer_fingerprint}; token counts and replay targets would be wrong. Rebuild the "
            f"archive with the training tokenizer."
        )
    if expected_dataset is not None and not _same_json(man.get("dataset"), expected_dataset):
        raise DatasetMismatchError(
            f"{path}: archive was built from dataset {man.get('dataset')!r}, not the expected {expected_dataset!r}"
        )
    if man.get("num_entries") == 0 and not allow_empty:
        raise EmptyArchiveError(
            f"{path}: the frozen archive has no entries; replay needs at least one "
            "(pass allow_empty=True to inspect it)"
        )

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:  # hash matched, so this is a writer/version problem
        raise ArchiveFileError(f"{path}: cannot read the parquet table ({exc})") from None
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise ArchiveFileError(f"{path}: parquet table lacks columns {missing}")
    if table.num_rows != man.get("num_entries"):
        raise ArchiveFileError(f"{path}: {table.num_rows} rows, manifest says {man.get('num_entries')}")
    cols = {c: table.column(c).to_pylist() for c in COLUMNS}
    entries = []
    for i in range(table.num_rows):
        pa_, pd_ = cols["parent_approach"][i], cols["parent_descriptor"][i]
        entries.append(
            FrozenEntry(
                question_id=cols["question_id"][i],
                approach=cols["approach"][i],
                descriptor=cols["descriptor"][i],
                text=cols["text"][i],
                num_tokens=int(cols["num_tokens"][i]),
                requested_approach=cols["requested_approach"][i],
                parent=None if pa_ is None else (pa_, pd_),
                insertion_round=int(cols["insertion_round"][i]),
                verification_reason=cols["verification_reason"][i],
                prompt=json.loads(cols["prompt_json"][i]),
                ground_truth=json.loads(cols["ground_truth_json"][i]),
                question_metadata=json.loads(cols["question_metadata_json"][i]),
                generation_metadata=json.loads(cols["generation_metadata_json"][i]),
            )
        )
    outside = sorted({e.approach for e in entries} - set(man.get("vocabulary", [])))
    if outside:
        raise ArchiveFileError(f"{path}: entries use approaches {outside} outside the manifest vocabulary")
    try:
        return FrozenArchive(entries, manifest=man)
    except ValueError as exc:
        raise ArchiveFileError(f"{path}: {exc}") from None


# convenience for callers that need a mutable manifest copy of a loaded archive
def manifest_dict(archive: FrozenArchive) -> dict[str, Any]:
    """A fresh mutable copy of ``archive.manifest``."""
    return thaw_json(archive.manifest)


def hf_tokenizer_fingerprint(tokenizer: Any) -> str:
    """:func:`~verl_replay.elite.archive_io.tokenizer_fingerprint` of a Hugging Face tokenizer.

    Covers the vocabulary, the special-token strings (added tokens marked special, plus the
    bos/eos/unk roles) and the chat template. The *pad* role is left out on purpose: the HF
    generation backend and verl both set ``pad_token = eos_token`` on tokenizers without one,
    padding is masked everywhere, and including it would make the same files fingerprint
    differently depending on who loaded them. Training code should fingerprint its tokenizer
    with this function to compare with an archive's manifest.
    """
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = sorted({tok.content for tok in added.values() if getattr(tok, "special", False)})
    roles = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token")}
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    return tokenizer_fingerprint(
        dict(tokenizer.get_vocab()),
        {"roles": {k: (str(v) if v is not None else None) for k, v in roles.items()}, "special": specials},
        template,
    )
