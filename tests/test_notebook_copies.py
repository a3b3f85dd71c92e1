"""The nbval copies in tests/notebooks/ run the notebooks' own code: each copy's cells are its
notebook's (``tests/notebooks/2_train.ipynb`` is ``notebooks/train.ipynb``), source for source,
besides the parameters cell papermill injected (``make notebooks`` writes the copies). Outputs are
nbval's to compare (tests/notebook_regression.py); a copy whose code drifted would test code the
notebooks no longer have."""

import difflib
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
COPIES = sorted((ROOT / "tests" / "notebooks").glob("*.ipynb"))
REFRESH = ("Fix: `make notebooks` (re-executes every copy, their outputs too), or, where only "
           "code changed that prints nothing new, copy the notebook's cell source into the copy")


def original(copy: Path) -> Path:
    """tests/notebooks/<N>_<name>.ipynb -> notebooks/<name>.ipynb."""
    return ROOT / "notebooks" / re.sub(r"^\d+_", "", copy.name)


def test_every_copy_has_its_notebook():
    assert [copy.name for copy in COPIES] == ["1_data_prep.ipynb", "2_train.ipynb",
                                              "3_sample_compare.ipynb", "4_profile.ipynb",
                                              "5_export.ipynb"]
    for copy in COPIES:
        assert original(copy).is_file(), f"{copy.name}: no {original(copy).relative_to(ROOT)}"


@pytest.mark.parametrize("copy", COPIES, ids=[copy.stem for copy in COPIES])
def test_a_copys_cells_are_its_notebooks(copy):
    source = original(copy)
    theirs = nbformat.read(source, as_version=4).cells
    ours = nbformat.read(copy, as_version=4).cells
    injected = [i for i, cell in enumerate(ours)
                if "injected-parameters" in cell.metadata.get("tags", [])]
    assert len(injected) == 1, f"{copy.name}: {len(injected)} injected-parameters cells, not 1"
    # papermill puts its cell right after the notebook's parameters cell.
    assert "parameters" in ours[injected[0] - 1].metadata.get("tags", []), copy.name
    ours = [cell for i, cell in enumerate(ours) if i != injected[0]]
    name, copy_name = source.relative_to(ROOT), copy.relative_to(ROOT)
    assert len(ours) == len(theirs), (
        f"{copy_name} has {len(ours)} cells besides its injected parameters, {name} "
        f"{len(theirs)}. {REFRESH}")
    for i, (mine, real) in enumerate(zip(ours, theirs, strict=True)):
        where = f"cell {i} of {name} ({real.source.splitlines()[0] if real.source else 'empty'!r})"
        assert mine.cell_type == real.cell_type, (
            f"{where} is a {real.cell_type} cell, {copy_name}'s a {mine.cell_type} cell. {REFRESH}")
        if mine.source != real.source:
            diff = "\n".join(difflib.unified_diff(
                mine.source.splitlines(), real.source.splitlines(), str(copy_name), str(name),
                lineterm=""))
            pytest.fail(f"{where} differs in {copy_name}:\n{diff}\n{REFRESH}")
        assert mine.metadata.get("tags", []) == real.metadata.get("tags", []), (
            f"{where}: tags {mine.metadata.get('tags', [])} in {copy_name}, "
            f"{real.metadata.get('tags', [])} in {name}. {REFRESH}")
