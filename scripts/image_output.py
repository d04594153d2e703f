"""Where a script may write an image: checked before anything is read or written (matplotlib picks the
format by the extension, and for a name without one writes PATH.png, elsewhere than asked); and writing
one, or any output file, so that an interrupted write leaves no cut file under the name asked for."""

import os
from collections.abc import Callable
from pathlib import Path


def file_problem(path: str) -> str | None:
    """Why no file can be written at `path` (None: one can), checked before anything is written."""
    folder = Path(path).parent
    if Path(path).is_dir():
        return "is a folder: name a file in it"
    if not folder.is_dir():
        return f"its folder {folder} does not exist"
    return None if os.access(folder, os.W_OK) else f"its folder {folder} is not writable"


def image_problem(path: str) -> str | None:
    """file_problem, or an extension matplotlib cannot write: it picks the format by the extension, and for a
    name without one writes PATH.png, elsewhere than asked."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})  # pgf needs TeX, fails mid-write
    problem, suffix = file_problem(path), Path(path).suffix
    if problem or suffix.lower()[1:] in formats:
        return problem
    named = f"{suffix} is not an image format matplotlib writes" if suffix else "has no extension"
    return f"{named}: end it in one of {', '.join('.' + f for f in formats)}"


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(partial)` to a file beside `path` (same extension, so matplotlib picks the same format), then
    renamed over it: a Ctrl-C or a full disk mid-write leaves an earlier file of that name as it was."""
    target = Path(os.path.realpath(path))  # through a symlink (latest.png -> runs/x.png): its file is replaced
    partial = target.with_name(f".{target.stem}.partial-{os.getpid()}{target.suffix}")
    try:
        write(str(partial))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def save_figure(fig, path: str) -> None:
    """The figure written to `path` atomically, then closed."""
    import matplotlib.pyplot as plt

    try:
        write_atomically(path, lambda partial: fig.savefig(partial, dpi=120))
    finally:
        plt.close(fig)
