"""Result files: whether a folder can take them, asked of the file system before a run
starts; each file written whole or not at all; and a save that fails during a run (a full
disk, a folder removed or made read-only) losing nothing: the file goes to a folder of the
run's own in the system's temporary folder instead, and the run ends saying so.

The standard library only (tools/gpu_check.py, which imports no torch, uses it too):

    problem = folder_problem("results")      # None, or why not, in words
    save_file("results/x.json", lambda f: f.write(data))
    print(wrote("results", "x.json"))         # "wrote results/x.json", or where it went
    for line in unsaved(): ...                # what could not be saved where asked
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path


# ----------------------------------------------------------------------------------------
# Before the run: can the folder take files?
# ----------------------------------------------------------------------------------------
def folder_problem(folder) -> str | None:
    """Why files cannot be written in ``folder`` (None: they can), asked of the file system
    itself, not of the permission bits (which root always passes, even on /proc or a
    read-only mount): a probe file is written in the folder, or, where the folder does not
    exist yet, in a probe folder made in its nearest existing parent. Both are removed: the
    disk is left as it was."""
    path = Path(folder).absolute()
    if _exists(path) and not path.is_dir():
        return "is a file, not a folder: choose a folder"
    existing = next(q for q in [path, *path.parents] if _exists(q))
    if not existing.is_dir():
        return f"cannot be made ({existing} is a file, not a folder): choose a folder"
    made = None   # the probe folder, made where the folder would be
    try:
        if existing != path:
            made = tempfile.mkdtemp(dir=existing, prefix=".kit-probe-")
        with tempfile.TemporaryFile(dir=made or existing) as f:   # unlinked at once: nothing left if killed
            f.write(b"probe")
            f.flush()
    except OSError as e:
        return (f"cannot be {'written to' if existing == path else 'made'} ({why_not(e, existing)}): "
                f"choose another folder")
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
    return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:   # there, in a folder this process may not look into: the probe then says why
        return True


def why_not(e: OSError, where) -> str:
    """What an OSError of writing in folder ``where`` means, in words."""
    return {errno.EROFS: f"{where} is on a read-only file system",
            errno.ENOSPC: f"the disk holding {where} is full",
            errno.EDQUOT: f"the disk quota for {where} is used up",
            errno.EACCES: f"{where} is not writable: permission denied",
            errno.EPERM: f"{where} does not allow it: operation not permitted",
            errno.ENOTDIR: f"{where} is not a folder",
            errno.EISDIR: f"a folder in {where} has the file's name"}.get(e.errno, f"{where} refused: {e.strerror or e}")


# ----------------------------------------------------------------------------------------
# During the run: each file whole, and what fails goes elsewhere
# ----------------------------------------------------------------------------------------
UMASK = os.umask(0o022)
os.umask(UMASK)


def atomic_write(path: Path, write):
    """``write(f)`` fills a temporary file beside ``path``, which then replaces ``path``:
    a reader never sees half a file, and a killed run leaves none (OSError as it came)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~UMASK)   # mkstemp makes it private; results are for sharing
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_UNSAVED: list = []       # (file, why, where it went instead or None): what the run could not save where asked
_FALLBACK: list = []      # the folder those went to, made at the first


def reset():
    """A new run (run_main calls it): nothing unsaved yet."""
    _UNSAVED.clear()
    _FALLBACK.clear()


def save_file(path, write) -> Path | None:
    """Write a result file atomically (``write(f)`` fills it). Where that fails (a full
    disk, the folder removed or made read-only during the run), the run goes on, and what it
    printed stays printed: the file is written elsewhere instead (elsewhere), and the run
    ends with one line naming it, why, and where it went (unsaved), and a failed exit
    status. Returns where the file is (None: nowhere)."""
    path = Path(path)
    try:
        atomic_write(path, write)
        _UNSAVED[:] = [u for u in _UNSAVED if u[0] != path]   # (rewritten: saved after all)
        return path
    except OSError as e:
        where = elsewhere(path, e)
    try:
        if where:
            atomic_write(where, write)
    except OSError as e:
        _UNSAVED[-1] = (path, f"{_UNSAVED[-1][1]}; nor in {where.parent}: {e.strerror or e}", None)
        where = None
    return where


def elsewhere(path, error: OSError) -> Path | None:
    """Where a file that could not be written at ``path`` (``error``) goes instead: a folder
    of the run's own in the system's temporary folder, made at the first such file (None
    where it cannot be made). Recorded either way, for the run's closing lines (unsaved)."""
    path, where = Path(path), None
    why = why_not(error, path.parent)
    try:
        if not _FALLBACK:
            _FALLBACK.append(Path(tempfile.mkdtemp(prefix=f"{Path(sys.argv[0]).stem or 'kit'}-unsaved-")))
        where = _FALLBACK[0] / path.name
    except OSError as e:
        why += f"; nor in {tempfile.gettempdir()}: {e.strerror or e}"
    _UNSAVED.append((path, why, where))
    return where


def unsaved() -> list[str]:
    """The files the run could not write where asked: one line a folder and reason."""
    groups = {}
    for path, why, where in _UNSAVED:
        groups.setdefault((path.parent, why), []).append((path.name, where))
    lines = []
    for (folder, why), files in groups.items():
        names = ", ".join(dict.fromkeys(n for n, _ in files))
        went = {str(w.parent) for _, w in files if w}
        lines.append(f"could not save {names} in {folder} ({why}): "
                     + (f"saved in {', '.join(sorted(went))} instead" if went else "only what was printed remains"))
    return lines


def wrote(where, what: str | None = None) -> str:
    """The line to print once ``what`` (say "05_x.json and .md") is saved in folder
    ``where``, or the file ``where`` alone: "wrote ..." where all of it went there, else
    where it went instead (said again as the run ends)."""
    missed = [u for u in _UNSAVED if (u[0].parent if what else u[0]) == Path(where)]
    if not missed:
        return f"wrote {where}/{what}" if what else f"wrote {where}"
    went = sorted({str(w.parent) for _, _, w in missed if w})
    return (f"could not write {len(missed)} file(s) of {f'{where}/{what}' if what else where} there: "
            + (f"saved in {', '.join(went)} instead" if went else "not saved") + " (see the last lines)")
