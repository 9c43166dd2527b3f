"""An output file's folder made and its writability checked before the work that fills it:
a benchmark or an evaluation that ran for minutes is never lost to a missing folder."""

from __future__ import annotations

import os

from kiln.errors import KilnError


def check_output_file(path: str, flag: str) -> None:
    """Make `path`'s folder; a one-line error (naming `flag`) if the file cannot be written."""
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise KilnError(f"{flag} {path}: cannot make its folder ({exc.strerror})") from None
    if os.path.isdir(path):
        raise KilnError(f"{flag} {path} is a folder; give a file name")
    exists = os.path.exists(path)
    if not os.access(path if exists else folder, os.W_OK):
        raise KilnError(f"{flag} {path}: not writable")
