"""One harness run on the ``scifact_small`` folder per test session, shared by test_harness, test_adapt and
test_sweeps (indexes and runs cached under the session's base temp folder)."""
import json
from pathlib import Path

from workers import built_once

SYSTEMS = ("bm25", "dense", "aligner", "aligner-exact", "aligner-pruned", "hybrid", "rrf", "aligner-adapted")


def harness_run(tmp_path_factory, folder: Path) -> tuple[Path, Path, dict]:
    """(output folder, cache folder, results.json) of ``python -m eval.beir`` with every system on ``folder``."""
    from eval.beir.__main__ import main

    with built_once(tmp_path_factory, "harness-out") as output:
        cache = output.with_name("harness-cache")
        if not (output / "results.json").is_file():
            assert main(["--dataset", str(folder), "--output", str(output), "--cache", str(cache), "--quiet"]) == 0
    return output, cache, json.loads((output / "results.json").read_text())


def harness_context(folder: Path, cache: Path):
    """A Context over the same dataset and cache as :func:`harness_run` (its indexes and runs are reused)."""
    from eval.beir.context import Context, harness_dtype, work_dir
    from pyserini_aligner.data import Dataset

    dataset = Dataset(str(folder))
    return Context(dataset=dataset, work=work_dir(dataset, cache), progress=False, dtype=harness_dtype())
