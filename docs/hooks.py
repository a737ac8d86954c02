"""MkDocs hooks (registered under `hooks:` in mkdocs.yml): add the generated reference pages.

The pages exist only in memory during the build (``File.generated``), so they are never stale
and never committed; ``docs/gen_reference.py`` has the generators.
"""

from __future__ import annotations

from mkdocs.structure.files import File, Files

import gen_reference  # docs/ is on sys.path while MkDocs loads this module


def on_files(files: Files, config, **kwargs) -> Files:
    for src_uri, markdown in gen_reference.generate().items():
        existing = files.get_file_from_path(src_uri)
        if existing is not None:  # a stale copy on disk: the generated page wins
            files.remove(existing)
        files.append(File.generated(config, src_uri, content=markdown + "\n"))
    return files
