"""The built-in default model: the checkpoint atomd serves when no `--model` is given.

The trained weights ship inside the package (default_checkpoint/, made by
scripts/train_default_model.py). Engines load them from a cache directory that is
written once, through a temp dir and an atomic rename, and checked against the
package's SHA256SUMS manifest, so a half-written or stale cache is rebuilt.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

PACKAGED_CHECKPOINT = pathlib.Path(__file__).resolve().parent / "default_checkpoint"
MANIFEST = "SHA256SUMS"
# Stdlib files (relative to sysconfig's stdlib path) kept out of training, for evaluation.
HELD_OUT_FILES = ("textwrap.py", "fractions.py", "shlex.py")


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ATOMD_CACHE_DIR") or pathlib.Path.home() / ".cache" / "atomd")


def default_model_dir() -> pathlib.Path:
    """The default checkpoint's directory in the cache, created or repaired on first use."""
    target = cache_root() / "default-model"
    if not is_intact(target):
        write_checkpoint(target)
    return target


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: pathlib.Path) -> None:
    """Record the sha256 of every file in `directory` (used by the training script)."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    lines = [f"{_sha256(directory / n)}  {n}\n" for n in names]
    (directory / MANIFEST).write_text("".join(lines))


def _read_manifest(directory: pathlib.Path) -> dict[str, str]:
    entries = {}
    for line in (directory / MANIFEST).read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        entries[name] = digest
    return entries


def is_intact(directory: pathlib.Path) -> bool:
    """True when `directory` holds exactly the packaged checkpoint, every file hash-checked."""
    try:
        if (directory / MANIFEST).read_bytes() != (PACKAGED_CHECKPOINT / MANIFEST).read_bytes():
            return False
        return all(_sha256(directory / n) == d for n, d in _read_manifest(directory).items())
    except (OSError, ValueError):
        return False


def write_checkpoint(dest: pathlib.Path) -> pathlib.Path:
    """Copy the packaged checkpoint to `dest`, replacing an earlier (possibly broken) copy.

    The copy is assembled and verified in a sibling temp dir and renamed into place, so a
    reader never sees a partial checkpoint. A non-empty `dest` that is not a copy of this
    checkpoint (no manifest) is refused rather than deleted.
    """
    dest = pathlib.Path(dest).expanduser().absolute()
    if dest.exists() and any(dest.iterdir()) and not (dest / MANIFEST).exists():
        raise ValueError(f"{dest} exists and is not an atomd default-model directory; refusing to overwrite")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared checkpoint from other users
        for name in _read_manifest(PACKAGED_CHECKPOINT):
            shutil.copyfile(PACKAGED_CHECKPOINT / name, tmp / name)
        shutil.copyfile(PACKAGED_CHECKPOINT / MANIFEST, tmp / MANIFEST)
        if not is_intact(tmp):
            raise RuntimeError(f"packaged default checkpoint {PACKAGED_CHECKPOINT} fails its {MANIFEST}")
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _swap_into_place(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    """Rename `tmp` to `dest`; an old `dest` is moved aside first and then deleted."""
    if dest.exists():
        old = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
        os.replace(dest, old / dest.name)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not is_intact(dest):  # another process won the race with a good copy: keep it
            raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", nargs="?", type=pathlib.Path, default=None,
                        help="where to write the checkpoint (default: the atomd cache, "
                             "$ATOMD_CACHE_DIR or ~/.cache/atomd, under default-model/)")


def run(args: argparse.Namespace) -> int:
    if args.dir is None:
        path = default_model_dir()
    else:
        try:
            path = write_checkpoint(args.dir)
        except ValueError as e:
            print(f"atomd make-default-model: error: {e}", file=sys.stderr)
            return 2
    print(path)
    return 0
