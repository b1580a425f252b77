"""Seeding a sandbox's working directory from a local "image" (a directory or a tar)."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path


def local_image_path(docker_image: str) -> Path | None:
    """The local content a ``docker_image`` names, or ``None`` for a real image name.

    ``local:<path>`` / ``dir:<path>`` / an absolute path name a directory (copied) or a
    ``.tar`` / ``.tar.gz`` / ``.tgz`` archive (extracted); anything else (a real image
    such as ``python:3.11-slim``) means an empty working directory.
    """
    for prefix in ("local:", "dir:"):
        if docker_image.startswith(prefix):
            return Path(docker_image[len(prefix) :]).expanduser()
    if os.path.isabs(docker_image):
        return Path(docker_image)
    return None


def seed(source: Path, work: Path) -> str | None:
    """Fill ``work`` from ``source`` (blocking); the error text when it cannot be used."""
    try:
        if source.is_dir():
            shutil.copytree(source, work, symlinks=True, dirs_exist_ok=True)
        elif source.is_file() and tarfile.is_tarfile(source):
            with tarfile.open(source) as tar:
                tar.extractall(work, filter="data")
        else:
            raise FileNotFoundError(f"no directory or tar archive at {source}")
    except Exception as e:  # a bad image is the sandbox's failure, as with a pull error
        return f"{e.__class__.__name__}: {e}"
    return None


__all__ = ["local_image_path", "seed"]
