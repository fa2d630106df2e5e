"""``metrics.jsonl`` that only ever holds whole lines.

verl's ``FileLogger`` opens its file with ``"wb"`` (truncating it) and writes each line with one
``write``. Even one ``write`` is not whole under SIGKILL: Linux copies a write into the page cache
page by page and stops between pages when the process gets a fatal signal, so a run killed while
it logs leaves a torn last line (``tests/integrations/verl/test_metrics_file.py`` shows it).

:class:`WholeLineFileLogger` takes verl's place in the TaskRunner process
(:func:`install_whole_line_file_logger`, the one name verl's ``Tracking`` looks up): every step
writes the file's whole content plus the new line to ``.metrics.jsonl.tmp`` and renames it over
``metrics.jsonl``. A rename is atomic, so a reader (the console's follower, ``compare``) and a run
killed at any moment see the old lines or the old lines plus the new one, never a part of it. The
rewrite costs O(file size) per step: ~10 KB per step line, a few MB after hundreds of steps. An
existing file is continued (a torn last line an older version left is dropped). Same interface
and line format as verl's: ``{"step": N, "data": {...}}``.
"""

from __future__ import annotations

import os
from typing import Any

import orjson

__all__ = ["WholeLineFileLogger", "install_whole_line_file_logger"]


class WholeLineFileLogger:
    """verl's ``FileLogger`` interface (``log(data, step)``, ``finish()``), one atomic rename per line."""

    def __init__(self, project_name: str, experiment_name: str) -> None:
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.filepath = os.getenv("VERL_FILE_LOGGER_PATH")
        if self.filepath is None:  # verl's default place
            directory = os.path.join(os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", ".")), project_name)
            os.makedirs(directory, exist_ok=True)
            self.filepath = os.path.join(directory, f"{experiment_name}.jsonl")
        folder, name = os.path.split(os.path.abspath(self.filepath))
        self._tmp = os.path.join(folder, f".{name}.tmp")
        try:
            with open(self.filepath, "rb") as handle:
                content = handle.read()
        except FileNotFoundError:
            content = b""
        self._content = bytearray(content[: content.rfind(b"\n") + 1])  # whole lines only
        self._replace()

    def log(self, data: dict[str, Any], step: int) -> None:
        self._content += orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        self._replace()

    def _replace(self) -> None:
        from verl_replay._files import default_file_mode

        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, default_file_mode())
        try:
            view = memoryview(self._content)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(self._tmp, self.filepath)

    def finish(self) -> None:
        return None


def install_whole_line_file_logger() -> None:
    """Make verl's ``Tracking`` build :class:`WholeLineFileLogger` for its ``file`` backend."""
    import verl.utils.tracking as tracking

    tracking.FileLogger = WholeLineFileLogger
