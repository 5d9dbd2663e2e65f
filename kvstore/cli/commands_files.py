"""Files in and out of a root: ``import``, ``export`` and ``inspect`` (mlx-bun files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import click

from . import render as H
from ._util import (
    UserError,
    common,
    emit,
    json_option,
    no_root,
    open_store,
    opts,
    oserror_line,
    progress,
)

__all__ = ["export", "import_", "inspect_"]


@click.command(name="import")
@click.argument("files", nargs=-1, required=True, metavar="FILE...",
                type=click.Path(path_type=Path))
@json_option
@common
def import_(files: tuple[Path, ...], as_json: bool) -> None:
    """Import mlx-bun cache files into the root.

    Accepts v3/v4 single files and v5 manifest files (with blocks/ beside them). Each
    file's outcome is printed as it is known (imported, already present, or an error
    line); the exit status is 2 when any file failed, after the others were imported.
    """
    from ..errors import KVStoreError

    done: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    with open_store(writes="import") as store, progress(len(files), "import", "file") as advance:
        for f in files:
            try:
                if not f.is_file():
                    raise UserError("no such file" if not f.exists() else "not a file")
                info = store.import_file(f)
            except (KVStoreError, UserError, OSError) as e:
                line = oserror_line(e) if isinstance(e, OSError) and not isinstance(
                    e, KVStoreError) else str(e)
                failed.append({"file": str(f), "error": line if str(f) in line else f"{f}: {line}"})
                click.echo(f"kvstore: error: {failed[-1]['error']}", err=True)
            else:
                status = "imported" if info.created else "present"
                done.append({"file": str(f), "status": status, **H.report_dict(info)})
                if not as_json and not opts().quiet:
                    click.echo(_import_line(done[-1]))
            advance(1)
    if as_json:
        emit({"root": str(store.root), "imported": done, "failed": failed})
    if failed:
        click.get_current_context().exit(2)


def _import_line(d: dict[str, Any]) -> str:
    what = f"{d['file']} -> {H.short_id(d['id'])} ({H.plural(d['n_tokens'], 'token')}, " \
           f"{H.format_bytes(d['logical_bytes'])}"
    if d["status"] == "present":
        return f"already present: {what})"
    return f"imported {what}, {H.format_bytes(d['new_bytes'])} new)"


@click.command()
@click.argument("entry")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["v3", "v5"]), default="v3", show_default=True,
              help="v3: one self-contained file; v5: a manifest file plus blocks/ beside it.")
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
@json_option
@common
def export(entry: str, path: Path, fmt: Literal["v3", "v5"], force: bool, as_json: bool) -> None:
    """Write one entry as an mlx-bun cache file.

    ENTRY is an id or a unique prefix of one. An existing PATH is kept unless --force
    is given. With --format v5 the blocks go to PATH's directory, under blocks/ (a
    block already there is not rewritten).
    """
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a file to write")
    if (path.exists() or path.is_symlink()) and not force:
        raise UserError(f"{path} exists; give --force to overwrite it")
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such directory")
    with open_store() as store:
        eid = store.resolve(entry)
        n_tokens = store.manifest(eid).n_tokens
        with progress(None, "export") as advance:
            store.export(eid, path, format=fmt)
            advance(1)
    size = path.stat().st_size if path.is_file() else None
    out: dict[str, Any] = {"root": str(store.root), "id": eid, "path": str(path), "format": fmt,
                           "n_tokens": n_tokens, "file_bytes": size}
    if fmt == "v5":  # the header file is the small part: say what its blocks hold
        from ..formats.v3 import v5_blocks

        blocks = v5_blocks(path)
        out.update(blocks_dir=str(path.parent / "blocks"), block_files=len(blocks),
                   block_bytes=sum(blocks.values()))
    if as_json:
        emit(out)
    elif not opts().quiet:
        what = f", {H.format_bytes(size)}" if size is not None else ""
        if fmt == "v5":
            what = (f", a {H.format_bytes(size or 0)} header file + "
                    f"{H.format_bytes(out['block_bytes'])} in "
                    f"{H.plural(out['block_files'], 'block file')} under {out['blocks_dir']}/")
        click.echo(f"exported {H.short_id(eid)} to {path} ({fmt}, "
                   f"{H.plural(n_tokens, 'token')}{what})")


@click.command(name="inspect")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--tokens", "all_tokens", is_flag=True, help="Print every token, not the first 16.")
@json_option
@no_root  # a file, not a root
def inspect_(file: Path, all_tokens: bool, as_json: bool) -> int:
    """Describe an mlx-bun cache file.

    Prints the prefix, the header, each layer's kind and fields and each tensor's
    shape, dtype and size; reads no tensor data. Every header field is checked as
    mlx-bun's reader checks it (a malformed file is an error, exit 2); a file
    that ends before its header or tensors do is reported as truncated (exit 1).
    """
    from ..formats.errors import TensorOutOfBoundsError, TruncatedFileError
    from ..formats.v3 import check_header, read_header

    if file.is_dir():
        raise UserError(f"{file}: is a directory, not a cache file")
    truncated: str | None = None
    try:
        info = read_header(file)
    except TruncatedFileError as e:
        info, truncated = None, e.reason
    if info is not None:
        try:
            check_header(info)
        except (TruncatedFileError, TensorOutOfBoundsError) as e:  # the file ends too early
            truncated = e.reason
    if as_json:
        out: dict[str, Any] = {"path": str(file)}
        if info is not None:
            out.update({"file_bytes": info.file_size, "format_version": info.format_version,
                        "header_len": info.header_len, "data_start": info.data_start,
                        "header_hash": info.header_hash_hex, "header": info.header})
        if truncated is not None:
            out["truncated"] = truncated
        emit(out)
    elif info is not None:
        click.echo("\n".join(H.header_lines(info, all_tokens=all_tokens)))
    if truncated is not None:
        click.echo(f"kvstore: {file}: truncated: {truncated}", err=True)
        return 1
    return 0
