"""The demo's results directory: ``results.jsonl`` (one line per finished rollout, appended
and flushed as each finishes) and ``metadata.json`` (rewritten atomically).

Layout::

    DIR/
      metadata.json   env, model, options, versions, isolation, timings, counts, status
      results.jsonl   one rollout per line, in verifiers' output format
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Iterable
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import IO, Any

from rollout_gateway.demo.options import DemoError

RESULTS_FILE = "results.jsonl"
METADATA_FILE = "metadata.json"


def versions() -> dict[str, str]:
    """Versions of the packages a result depends on."""
    found = {"python": platform.python_version()}
    for dist in ("rollout-gateway", "verifiers", "prime-sandboxes", "openai"):
        try:
            found[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def rollout_key(record: dict[str, Any]) -> tuple[int, int] | None:
    """(example_id, rollout_index) of a stored record (what ``--resume`` skips)."""
    try:
        return int(record["example_id"]), int(record["rollout_index"])
    except (KeyError, TypeError, ValueError):
        return None


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """Store each token list once: a step's ``response.message.tokens`` repeats
    ``step.tokens`` (the ids the trainer uses), so it is dropped when identical."""
    for step in record.get("trajectory") or []:
        response = step.get("response")
        message = response.get("message") if isinstance(response, dict) else None
        if isinstance(message, dict) and "tokens" in message:
            tokens = message["tokens"]
            step_tokens = step.get("tokens") or {}
            if tokens is None or all(step_tokens.get(k) == v for k, v in tokens.items()):
                del message["tokens"]
    return record


class ResultsDir:
    """Owns a results directory for one run (new or resumed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results = path / RESULTS_FILE
        self.metadata_path = path / METADATA_FILE
        self._file: IO[str] | None = None

    @classmethod
    def create(cls, path: Path) -> ResultsDir:
        """A new, empty directory (``DemoError`` if it holds results or is not writable)."""
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise DemoError(
                f"--output {path} already exists and is not an empty directory "
                f"(use --resume {path} to continue a run, or another --output)"
            )
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DemoError(f"cannot create the output directory {path}: {e.strerror}") from e
        results = cls(path)
        results._check_writable()
        return results

    @classmethod
    def open_existing(cls, path: Path) -> tuple[ResultsDir, dict[str, Any], list[dict[str, Any]]]:
        """An interrupted run's directory: (dir, its metadata, its finished records)."""
        results = cls(path)
        try:
            meta = json.loads(results.metadata_path.read_text())
        except FileNotFoundError:
            raise DemoError(f"--resume {path}: no {METADATA_FILE} (not a demo run)") from None
        except (OSError, ValueError) as e:
            raise DemoError(f"--resume {path}: cannot read {METADATA_FILE}: {e}") from None
        records = list(results.read_records())
        results._check_writable()
        return results, meta, records

    def _check_writable(self) -> None:
        try:
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".write-test-"):
                pass
            self._file = self.results.open("a", encoding="utf-8")
        except OSError as e:
            raise DemoError(f"cannot write results to {self.path}: {e.strerror or e}") from e

    def read_records(self) -> Iterable[dict[str, Any]]:
        """Finished records; a torn last line (a killed writer) is ignored."""
        try:
            lines = self.results.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Append one finished rollout (as plain JSON, token lists once), flushed to the OS;
        returns the record as stored."""
        from verifiers.utils.save_utils import make_serializable

        assert self._file is not None
        stored = compact(json.loads(json.dumps(record, default=make_serializable)))
        self._file.write(json.dumps(stored) + "\n")
        self._file.flush()
        return stored

    def write_metadata(self, metadata: dict[str, Any]) -> None:
        """Replace ``metadata.json`` atomically (a reader never sees half of it)."""
        tmp = self.metadata_path.with_name(f".{METADATA_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.metadata_path)

    def close(self) -> None:
        """Close the results file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def now_iso() -> str:
    """Current UTC time, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


__all__ = [
    "METADATA_FILE",
    "RESULTS_FILE",
    "ResultsDir",
    "compact",
    "now_iso",
    "rollout_key",
    "versions",
]
