"""JSON results and all-or-nothing files: the one owner of how results reach the disk.

- :func:`encode_float` / :func:`decode_float` (and :func:`encode_tree` /
  :func:`decode_tree` for nested records): non-finite values are kept as the strings
  ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, so JSON holds them without NaN literals and
  floats round-trip exactly;
- :func:`atomic_path`, :func:`write_text_atomic`, :func:`write_json_atomic`: a file is
  written completely or not at all (temporary file in the same folder + ``os.replace``),
  with the permissions an ordinary ``open`` would give (:func:`default_mode`); a symbolic
  link is written through (the file it names is replaced, the link is kept), anything
  that is not a regular file (a device node, a FIFO, a folder) is refused
  (:func:`regular_target`), and ``overwrite=False`` refuses a file that exists at the
  final rename;
- :class:`JsonResult`: the mixin every report class uses for ``to_json``/``from_json``,
  on top of its own ``to_dict``/``from_dict``, with one contract;
- folders written all or nothing: :func:`staging_folder` (a locked sibling folder named
  :data:`STAGING_PREFIX` ``+ <target>.<kind>-<random>``), :func:`lock_folder` /
  :func:`unlock` (``flock``, released by the kernel however the process dies),
  :func:`move_into_place` (the final rename, which refuses a target another writer filled
  meanwhile), :func:`carry_over` (what a folder held besides what a save replaces, linked
  into the staged folder before it is moved into place) and :func:`remove_stale_staging`
  (the unlocked leftovers of killed saves, ours only).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import numbers
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

__all__ = [
    "JsonResult",
    "STAGING_PREFIX",
    "atomic_path",
    "carry_over",
    "decode_float",
    "decode_tree",
    "default_mode",
    "encode_float",
    "encode_tree",
    "lock_folder",
    "move_into_place",
    "regular_target",
    "remove_stale_staging",
    "staging_folder",
    "unlock",
    "write_json_atomic",
    "write_text_atomic",
]

logger = logging.getLogger(__name__)


def encode_float(x):
    """JSON-safe float: non-finite values become the strings 'NaN', 'Infinity', '-Infinity'."""
    if x is None or isinstance(x, str):
        return x
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def decode_float(x):
    """Inverse of :func:`encode_float`."""
    if x is None:
        return None
    if isinstance(x, str):
        if x not in ("NaN", "Infinity", "-Infinity"):
            raise ValueError(f"value {x!r} is not a number: allowed a JSON number, null, 'NaN', 'Infinity' or '-Infinity'")
        return float({"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[x])
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"value {x!r} is not a number: allowed a JSON number, null, 'NaN', 'Infinity' or '-Infinity'")
    return float(x)


def default_mode(path: str | os.PathLike) -> None:
    """Give a file or folder made by ``tempfile`` (mode 0600/0700) the permissions an
    ordinary ``open``/``mkdir`` would have given it (0666/0777 less the umask), so
    atomically written results are as readable as any other file the user writes."""
    try:  # Linux: read the umask without changing it (other threads may be creating files)
        with open("/proc/self/status", encoding="ascii") as fh:
            mask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def regular_target(path: str | os.PathLike) -> Path:
    """The file a write of ``path`` replaces: ``path`` with every symbolic link followed
    (a link is written through, never replaced; a link to a missing file names the file
    to create), which must be a regular file or not exist yet.

    Raises:
        FileExistsError: the target is a folder.
        ValueError: the target is a device node, a FIFO or a socket (replacing
            ``/dev/null`` with a regular file would break the system), or a link that
            never resolves (a loop); the message names ``path`` and what it is.
    """
    given = Path(path)
    target = Path(os.path.realpath(given))
    try:
        mode = os.lstat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):  # to be created (a path under a file fails when written)
        return target
    except OSError as err:  # ELOOP and the like: not a file we can name
        raise ValueError(f"{os.fspath(path)} cannot be resolved to a file ({err.strerror}); give a regular file's "
                         "path") from None
    if stat.S_ISREG(mode):
        return target
    where = "" if target == Path(os.path.abspath(given)) else f" (the link's target {target})"
    if stat.S_ISDIR(mode):
        raise FileExistsError(f"{os.fspath(path)}{where} is a folder; give a file's path")
    if stat.S_ISLNK(mode):
        raise ValueError(f"{os.fspath(path)} is a symbolic link that does not resolve (a loop); give a regular "
                         "file's path")
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise ValueError(f"{os.fspath(path)}{where} is {kind}, not a regular file: results are written only to regular "
                     "files (or through a symbolic link to one); give a file's path")


def _place(tmp: str, target: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` onto ``target``; without ``overwrite`` the kernel
    refuses a ``target`` that exists at that moment (a hard link made only if the name is
    free, then the temporary name removed)."""
    if overwrite:
        os.replace(tmp, target)
        return
    refusal = f"{target} exists (written while this result was computed?); it was left as it was"
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise FileExistsError(refusal) from None
    except OSError as err:  # a file system without hard links: check, then rename
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV):
            raise
        if os.path.lexists(target):
            raise FileExistsError(refusal) from None
        os.replace(tmp, target)
        return
    os.unlink(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = ".tmp", overwrite: bool = True) -> Iterator[Path]:
    """Context manager for an all-or-nothing write of ``path``: yields a temporary file in
    the same folder (name ending in ``suffix``, e.g. ``".png"`` for writers that read the
    format from it) for the caller to write; on a normal exit it replaces ``path`` with
    one ``os.replace``, on any exception (including KeyboardInterrupt) it is removed and
    ``path`` is left as it was. The file gets ordinary permissions (:func:`default_mode`).

    A symbolic link ``path`` is written through: the temporary file is made next to the
    file the link names, which is replaced, and the link stays a link
    (:func:`regular_target`). Anything that is not a regular file is refused before
    anything is written. With ``overwrite=False`` the final rename refuses a ``path`` that
    exists by then (``FileExistsError``, the temporary file removed, ``path`` untouched).

    Raises:
        FileExistsError, ValueError: as :func:`regular_target`; ``FileExistsError`` also
            for an existing ``path`` without ``overwrite``.
    """
    path = regular_target(path)
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{path} exists; it was left as it was")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        default_mode(tmp)
        yield Path(tmp)
        _place(tmp, path, overwrite)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(text: str, path: str | os.PathLike, *, overwrite: bool = True) -> Path:
    """Write UTF-8 ``text`` to ``path`` all or nothing (:func:`atomic_path`; a symbolic link
    is written through, a non-regular file refused, an existing file refused without
    ``overwrite``)."""
    with atomic_path(path, overwrite=overwrite) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(data, path: str | os.PathLike, *, overwrite: bool = True) -> Path:
    """Write ``data`` as indented JSON (no NaN/Infinity literals: ValueError) all or nothing
    (:func:`write_text_atomic`)."""
    return write_text_atomic(json.dumps(data, indent=2, allow_nan=False) + "\n", path, overwrite=overwrite)


def encode_tree(x):
    """:func:`encode_float` applied to every float inside nested dicts/lists/tuples
    (tuples become lists, keys become strings)."""
    if isinstance(x, float):
        return encode_float(x)
    if isinstance(x, dict):
        return {str(k): encode_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode_tree(v) for v in x]
    return x


def decode_tree(x):
    """Inverse of :func:`encode_tree`: the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` inside nested dicts/lists become floats again."""
    if isinstance(x, str) and x in ("NaN", "Infinity", "-Infinity"):
        return decode_float(x)
    if isinstance(x, dict):
        return {k: decode_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode_tree(v) for v in x]
    return x


def _json_text(data) -> str:
    return json.dumps(encode_tree(data), indent=2, allow_nan=False) + "\n"


class JsonResult:
    """``to_json`` / ``from_json`` for a result class that defines ``to_dict()`` (a
    JSON-able dict) and the classmethod ``from_dict(dict)``. One contract for every report:

    - ``to_json(path=None, *, overwrite=True)``: with ``path``, writes indented JSON all
      or nothing (:func:`write_text_atomic`: through a symbolic link, never onto a device
      node or a FIFO; ``overwrite=False`` refuses an existing file) and returns the
      :class:`~pathlib.Path`; without it, returns the same JSON text as a ``str``. Non-finite floats are written as
      ``"NaN"``/``"Infinity"``/``"-Infinity"`` strings, never as NaN literals.
    - ``from_json(source)``: ``source`` is a path (``str`` or ``os.PathLike``) to a file
      written by ``to_json``, or the JSON text itself (a ``str`` starting with ``{``);
      keyword ``options`` go to ``from_dict`` (``SwapReport``'s ``trust``).

    Raises (``from_json``):
        FileNotFoundError: ``source`` names no file.
        ValueError: invalid JSON (e.g. a truncated file) or content ``from_dict`` refuses;
            the message names the file (or "JSON text") and the class.
    """

    if TYPE_CHECKING:  # what a result class defines (the mixin itself has neither)
        to_dict: Callable[..., dict]
        from_dict: ClassVar[Callable[..., Any]]

    def to_json(self, path: str | os.PathLike | None = None, *, overwrite: bool = True):
        text = _json_text(self.to_dict())
        if path is None:
            return text
        return write_text_atomic(text, path, overwrite=overwrite)

    @classmethod
    def from_json(cls, source: str | os.PathLike, **options):
        if isinstance(source, str) and source.lstrip().startswith("{"):
            where, text = "JSON text", source
        else:
            where = os.fspath(source)
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        try:
            return cls.from_dict(json.loads(text), **options)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            detail = str(err) if type(err) is ValueError or isinstance(err, json.JSONDecodeError) else (
                f"{type(err).__name__}: {err}"
            )
            raise ValueError(f"{where} is not a valid {cls.__name__} JSON file: {detail}") from None


# ----------------------------------------------------------------------------- folders
#: Name prefix of the staging folders :func:`save_for_hub` makes next to its target. Only
#: folders starting with exactly this are ever removed as stale.
STAGING_PREFIX = ".hf_layerswap-staging-"


def lock_folder(path: Path, *, wait: bool) -> int | None:
    """An exclusive ``flock`` on the folder ``path`` (released by the kernel when the process
    dies, however it dies): the descriptor, or ``None`` when another process holds it (or the
    platform has no ``flock``: then nothing counts as stale)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def unlock(fd: int | None) -> None:
    """Release a lock taken by :func:`lock_folder` (``None``: nothing to release)."""
    if fd is not None:
        os.close(fd)


def staging_folder(target: Path, kind: str) -> tuple[Path, int | None]:
    """A new staging folder next to ``target``, ``STAGING_PREFIX + name.kind-XXXX``, and the
    descriptor of its lock (:func:`lock_folder`; ``None`` where the platform has no flock)."""
    while True:
        path = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{target.name}.{kind}-", dir=target.parent))
        fd = lock_folder(path, wait=True)
        try:  # a cleaner that saw it before the lock may have removed it: then make another
            if os.path.samestat(os.fstat(fd), path.stat()) if fd is not None else True:
                return path, fd
        except FileNotFoundError:
            pass
        unlock(fd)


def move_into_place(staged: Path, target: Path, *, overwrite: bool) -> None:
    """Rename the complete folder ``staged`` (a sibling of ``target``, e.g. from
    :func:`staging_folder`) to ``target`` in one step.

    Without ``overwrite`` the rename itself is the check, made by the kernel at the moment
    of the move: it succeeds only while ``target`` does not exist or is an empty folder. Of
    several writers racing for one target exactly one wins; the others get
    ``FileExistsError`` and the winner's folder is left as it is, however late they came.
    With ``overwrite`` an existing ``target`` is first moved into a locked ``previous``
    staging folder and removed after the rename (put back if the rename fails).

    Raises:
        FileExistsError: ``target`` exists and is not an empty folder (without
            ``overwrite``), or another writer put a folder there between the two renames
            (with it). ``staged`` is left for the caller to remove.
        OSError: the rename failed for another reason (e.g. a read-only parent folder).
    """
    refusal = (f"{target} exists and is not an empty folder (another writer may have saved there while this save "
               "ran); nothing of this save was left there: choose another folder, or remove that one and run again "
               "(from Python, save_for_hub(..., overwrite=True) replaces the files it writes there)")
    if not overwrite:
        try:
            os.rename(staged, target)
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise FileExistsError(refusal) from None
            raise
        return
    old, lock = staging_folder(target, "previous")
    try:
        try:
            os.replace(target, old / "previous")
        except FileNotFoundError:
            pass  # nothing there (any more)
        try:
            os.rename(staged, target)
        except OSError as err:
            if (old / "previous").exists() and not target.exists():
                os.replace(old / "previous", target)
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise FileExistsError(refusal) from None
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
        unlock(lock)


def carry_over(source: Path, staged: Path, *, replaced: Callable[[str], bool]) -> list[str]:
    """Link into the staged folder ``staged`` everything of the existing folder ``source``
    that the new save does not replace, so that moving ``staged`` into place
    (:func:`move_into_place` with ``overwrite``) keeps it: every file and folder, at any
    depth, except the paths ``staged`` already holds (the save writes them) and the files
    for which ``replaced(relative path)`` is true (stale files the saver owns, e.g. the
    shards of an earlier save). Files are hard-linked (the same data, nothing copied;
    copied where the file system has no hard links), symbolic links recreated as links.

    Returns:
        The relative paths carried over (files and links), sorted.

    Raises:
        FileExistsError: ``staged`` holds a file where ``source`` holds a folder or the other
            way round (the save would drop it); nothing is moved, the caller removes ``staged``.
    """
    carried: list[str] = []
    _carry(Path(source), Path(staged), "", replaced, carried)
    return sorted(carried)


def _carry(source: Path, staged: Path, prefix: str, replaced, carried: list[str]) -> None:
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        name, dst = prefix + entry.name, staged / entry.name
        if entry.is_dir(follow_symlinks=False):
            if os.path.lexists(dst) and not dst.is_dir():
                raise FileExistsError(f"{source / entry.name} is a folder and this save writes a file {name}: "
                                      "rename the folder, or choose another target")
            dst.mkdir(exist_ok=True)
            _carry(Path(entry.path), dst, name + "/", replaced, carried)
            continue
        if os.path.lexists(dst):
            if dst.is_dir() and not dst.is_symlink():
                raise FileExistsError(f"{source / entry.name} is a file and this save writes a folder {name}: "
                                      "rename the file, or choose another target")
            continue  # written by this save
        if replaced(name):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dst)
        else:
            try:
                os.link(entry.path, dst, follow_symlinks=False)
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV):
                    raise
                shutil.copy2(entry.path, dst, follow_symlinks=False)
        carried.append(name)


def remove_stale_staging(parent: str | os.PathLike) -> list[str]:
    """Remove the staging folders of interrupted saves (a killed process) in ``parent``.

    Only folders whose name starts with :data:`STAGING_PREFIX` and whose lock no live
    process holds are touched; every other file and folder is left alone. A stale
    ``<name>.previous-*`` folder (a save killed between its two renames) is moved back to
    ``<name>`` when nothing is there, else removed.

    Returns:
        The names removed (or restored), sorted; also logged at INFO level.
    """
    parent = Path(parent)
    done = []
    for entry in sorted(os.scandir(parent), key=lambda e: e.name):
        if not entry.name.startswith(STAGING_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = lock_folder(Path(entry.path), wait=False)
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
        if fd is None:
            continue  # a save in progress (or no flock on this platform)
        try:
            name, _, kind = entry.name[len(STAGING_PREFIX):].rpartition(".")
            previous = Path(entry.path) / "previous"
            if kind.startswith("previous-") and name and previous.is_dir() and not (parent / name).exists():
                os.replace(previous, parent / name)
            shutil.rmtree(entry.path, ignore_errors=True)
            done.append(entry.name)
        finally:
            unlock(fd)
    if done:
        logger.info("removed %d stale staging folder(s) of interrupted saves in %s: %s", len(done), parent, done)
    return done
