"""Tiled indexes: search-side figures at sizes too large to build within one run.

A tiled index lists one built index's immutable segments ``copies`` times in its own manifest. Each copy is a
segment folder of symbolic links to the source segment's files, except ``docids.txt``: copy 0 keeps the source's
docids (so the judged documents keep theirs), copy c > 0 appends ``~t<c>``. The codec folder is linked too. Its
search cost is that of an index of the tiled size; its quality figures are not those of a real corpus of that size
(every passage has ``copies - 1`` exact duplicates), and the report marks its rows "tiled".
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from pyserini_aligner.index.commit import new_name, write_manifest
from pyserini_aligner.index.format import DOCIDS, Manifest, read_manifest
from pyserini_aligner.index.io import file_record


def tile_index(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, copies: int) -> Manifest:
    """Write at ``dst_dir`` (a new folder) an index whose segments are ``src_dir``'s repeated ``copies`` times;
    returns its manifest. Nothing under ``src_dir`` is written; removing ``src_dir`` breaks the tiled index."""
    if copies < 1:
        raise ValueError(f"tile_index: copies must be >= 1, got {copies}")
    src, dst = Path(src_dir).absolute(), Path(dst_dir).absolute()
    source = read_manifest(src)
    dst.mkdir(parents=True)
    try:
        return _write_tiles(src, dst, source, copies)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)  # links and docids written here only; never the source
        raise


def _write_tiles(src: Path, dst: Path, source: Manifest, copies: int) -> Manifest:
    if source.codec_dir:
        os.symlink(src / source.codec_dir, dst / source.codec_dir, target_is_directory=True)
    segments = []
    for copy in range(copies):
        for info in source.segments:
            name = new_name("seg", source.generation)
            folder = dst / name
            folder.mkdir()
            files = dict(info.files)
            for path in (src / info.name).iterdir():
                if path.name != DOCIDS:
                    os.symlink(path, folder / path.name)
            docids = (src / info.name / DOCIDS).read_text(encoding="utf-8").splitlines()
            suffix = f"~t{copy}" if copy else ""
            (folder / DOCIDS).write_text("".join(f"{docid}{suffix}\n" for docid in docids), encoding="utf-8")
            if DOCIDS in files:
                files[DOCIDS] = file_record(folder / DOCIDS)
            segments.append(dataclasses.replace(info, name=name, files=files))
    manifest = dataclasses.replace(source, segments=segments, created="",
                                   corpus=f"{source.corpus or src} tiled x{copies}")
    write_manifest(dst, manifest)
    return manifest
