"""docs/api.md documents every public name: each has a docstring, and the
file is what `python -m opsmith.api_docs` generates from them."""
import opsmith.api_docs as api_docs


def test_every_public_name_has_a_docstring():
    assert api_docs.undocumented() == []
    names = [q for _, _, items in api_docs.public_names() for q, _ in items]
    assert "opsmith.rms_norm" in names and "opsmith.nn.RMSNorm" in names and "opsmith.hf.patch" in names


def test_api_md_is_current():
    assert api_docs.API_MD.read_text() == api_docs.render(), \
        "docs/api.md is stale: run python -m opsmith.api_docs"
