"""The script that fetches the released modeling code (``python -m scripts.fetch_released_models DIR``),
checked offline against the folder already in place: it cannot reach GitHub from the test machines, so its
download is replaced by reading the same files from that folder (each source URL maps to one file)."""
import importlib.util
import re
import sys

import pytest

from released import hub


def script():
    path = hub.REPO / "scripts" / "fetch_released_models.py"
    spec = importlib.util.spec_from_file_location("fetch_released_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_skip_reason_names_this_script():
    assert hub.FETCH_SCRIPT.startswith("python -m scripts.fetch_released_models ")
    assert (hub.REPO / "scripts" / "fetch_released_models.py").is_file()


def test_removing_dllms_block_from_dllms_dream_gives_the_released_dream():
    fetch = script()
    dllm = (hub.require("dream_dllm") / "modeling_dream.py").read_text(encoding="utf-8")
    released = (hub.require("dream") / "modeling_dream.py").read_text(encoding="utf-8")
    assert dllm != released
    assert fetch.without_dllm_mask_block(dllm) == released
    with pytest.raises(ValueError, match="^text: expected one line holding"):
        fetch.without_dllm_mask_block(released)  # the block is gone: nothing to remove


def test_every_source_is_a_pinned_github_file_whose_recorded_hash_is_the_folders():
    fetch = script()
    folders = {source.folder for source in fetch.SOURCES}
    assert folders == {spec.folder for spec in hub.FAMILIES.values()}
    for source in fetch.SOURCES:
        assert re.fullmatch(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/[\w./-]+\.py",
                            source.url), source.url
        path = hub.require(source.folder) / source.name
        assert fetch.sha256(path.read_bytes()) == source.sha256, path
    for spec in hub.FAMILIES.values():  # every file a checkpoint copies has a source
        assert {file for file in spec.files} <= {s.name for s in fetch.SOURCES if s.folder == spec.folder}


def _offline(fetch):
    """url -> the bytes of the folder's copy of that file as downloaded (dllm's Dream for both Dreams)."""
    files = {}
    for source in fetch.SOURCES:
        if not source.strip_dllm_block:
            files[source.url] = (hub.require(source.folder) / source.name).read_bytes()
    return files


def test_fetch_writes_the_folder_byte_for_byte(tmp_path):
    fetch = script()
    files = _offline(fetch)
    written = fetch.fetch(tmp_path, fetcher=files.__getitem__)
    assert sorted(written) == sorted(f"{s.folder}/{s.name}" for s in fetch.SOURCES)
    for path in written:
        folder, name = path.split("/")
        assert (tmp_path / path).read_bytes() == (hub.require(folder) / name).read_bytes(), path


def test_a_file_that_differs_from_the_recorded_one_is_not_written(tmp_path):
    fetch = script()
    files = _offline(fetch)
    changed = next(s for s in fetch.SOURCES if s.folder == "sdar" and s.name == "modeling_sdar.py")
    files[changed.url] += b"\n# changed\n"
    with pytest.raises(ValueError, match=r"^files differ from the recorded ones .*sdar/modeling_sdar\.py from https"):
        fetch.fetch(tmp_path, fetcher=files.__getitem__)
    assert not (tmp_path / "sdar" / "modeling_sdar.py").exists()
    assert (tmp_path / "llada" / "modeling_llada.py").exists()
    assert "sdar/modeling_sdar.py" in fetch.fetch(tmp_path / "all", accept_mismatch=True, fetcher=files.__getitem__)
