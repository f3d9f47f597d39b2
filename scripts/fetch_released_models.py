"""Fetch the families' released modeling code from its sources at the recorded commits.

    python -m scripts.fetch_released_models ../shared/released-models

writes one folder per family (``llada``, ``llada_dllm``, ``lladamoe``, ``dream``, ``dream_dllm``, ``sdar``,
``llada2``) holding the files a hub checkpoint of that family loads with ``trust_remote_code=True``: the
fixtures of the conformance tests in ``tests/released/``, which read them from ``../shared/released-models/``
beside the clone (or from ``DACA_RELEASED_MODELS``). Each file is downloaded from GitHub at a fixed commit
(:data:`SOURCES`) and checked against its recorded SHA-256; ``dream/modeling_dream.py`` is dllm's Dream file
with dllm's own attention-mask block removed from ``DreamModel.forward`` (:func:`without_dllm_mask_block`),
which makes it the code the other public copies and the hub's Dream checkpoints carry. The files are
third-party code under their own licences (Apache-2.0; LLaDA-8B's under MIT); the project never ships them.

Only the Python standard library is used. Offline, the tests check the removal step and the recorded
hashes against a folder already in place (``tests/released/test_fetch_script.py``).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DLLM_FIRST = "7b834e4e5197ee4a5072504589fd1ac54f90cb11"  # dllm's first commit, before its mask patch
DLLM_PATCHED = "ca176752fbceec49c6b4777a2c18ae88e4eb10ed"  # dllm's LLaDA that honours the attention mask
DLLM_LLADA2 = "85cb53a05343601c9dfbb4f79243cd426cfa5a4c"
LLADA_SAMPLER = "65cbed294263040cb6946c32a91e16cbdad209d2"
DLLM_RL = "10b4fd1cba83e4496c20585dc2fd01dc02f20255"

# dllm's Dream turns a 2-D mask into a 4-D one and refuses None; the released Dream passes the mask to
# SDPA as given. The block between these two lines (the first included, the second not) is dllm's.
DLLM_BLOCK_START = 'if isinstance(attention_mask, str) and attention_mask == "full":'
DLLM_BLOCK_END = "# decoder outputs consists of"


@dataclass(frozen=True)
class Source:
    """One released file: where it comes from, where it goes and what it must hash to.

    Attributes:
        folder: the family folder it is written to.
        name: its file name there.
        repo: the GitHub repository (``owner/name``).
        commit: the full commit id.
        path: its path in the repository at that commit.
        sha256: the SHA-256 of the file as written (after :func:`without_dllm_mask_block` for the
            released Dream).
        strip_dllm_block: whether dllm's attention-mask block is removed.
    """

    folder: str
    name: str
    repo: str
    commit: str
    path: str
    sha256: str
    strip_dllm_block: bool = False

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"


def _dllm(folder, name, commit, directory, sha256, strip=False):
    return Source(folder, name, "ZHZisZZ/dllm", commit, f"{directory}/{name}", sha256, strip)


_FIRST_LLADA = "dllm_trainer/pipelines/llada/models"
_FIRST_DREAM = "dllm_trainer/pipelines/dream/models"
_PATCHED_LLADA = "dllm/pipelines/llada/models"

SOURCES = (
    _dllm("llada", "modeling_llada.py", DLLM_FIRST, _FIRST_LLADA,
          "da1b94e13b4809bf3f4641eb894d46b81feb64b304477aaf062e59d93dbbe5ce"),
    _dllm("llada", "configuration_llada.py", DLLM_FIRST, _FIRST_LLADA,
          "c947a64d8b735affa69d5adeb416c83ce607c8925270884e4471ae11068e2bfe"),
    Source("llada", "generate.py", "ML-GSAI/LLaDA", LLADA_SAMPLER, "generate.py",
           "a95b1c67d2f9d6a80f7a2d046d59be215fd0cf010c771e9ec07f5b80eae7a9c7"),
    _dllm("llada_dllm", "modeling_llada.py", DLLM_PATCHED, _PATCHED_LLADA,
          "2c1b9bc3f19370fef98383f0670f98d5d803b0577484593f6b94857224cedbd0"),
    _dllm("llada_dllm", "configuration_llada.py", DLLM_PATCHED, _PATCHED_LLADA,
          "68a8f137dd3884941c46fd615a8f6baf10276cab9d0005dd2c28b63b8b2b52a6"),
    _dllm("lladamoe", "modeling_lladamoe.py", DLLM_FIRST, _FIRST_LLADA,
          "302256e7d8b968eb619fd2cb7ebb782863ae42b45f96228e8aca9203b688e71b"),
    _dllm("lladamoe", "configuration_lladamoe.py", DLLM_FIRST, _FIRST_LLADA,
          "3f009ef380ab2c23f01411d9843510936a9a02bac0bc382b6375ae06d035dcf5"),
    _dllm("dream", "modeling_dream.py", DLLM_FIRST, _FIRST_DREAM,
          "d0bdda27182588a77033ed38493733432e9543be68e64e285c473e09f525726e", strip=True),
    _dllm("dream", "configuration_dream.py", DLLM_FIRST, _FIRST_DREAM,
          "dca3fca021a405d3b89b4db2845ae31065f65e29d4da841336239443e7792991"),
    _dllm("dream", "generation_utils.py", DLLM_FIRST, _FIRST_DREAM,
          "b635865a96f4a9bc842d10ee0d55e38d8ef82d7e6135f286c73f9c688729d46a"),
    _dllm("dream_dllm", "modeling_dream.py", DLLM_FIRST, _FIRST_DREAM,
          "9c0391247e1e2e1d86c7a58be1db2fe80996ee249c9407ab3b1131e026703eb9"),
    _dllm("dream_dllm", "configuration_dream.py", DLLM_FIRST, _FIRST_DREAM,
          "dca3fca021a405d3b89b4db2845ae31065f65e29d4da841336239443e7792991"),
    _dllm("dream_dllm", "generation_utils.py", DLLM_FIRST, _FIRST_DREAM,
          "b635865a96f4a9bc842d10ee0d55e38d8ef82d7e6135f286c73f9c688729d46a"),
    Source("sdar", "modeling_sdar.py", "Gen-Verse/dLLM-RL", DLLM_RL, "models/sdar/modeling_sdar.py",
           "6ebf3124a5fd17171be0d2f6f7674eb76dcf997a8a6cae8720131187bb30ac95"),
    Source("sdar", "configuration_sdar.py", "Gen-Verse/dLLM-RL", DLLM_RL, "models/sdar/configuration_sdar.py",
           "73f6e1eaa4018f2f4023c4c9f90a4a401f67762a106644e248c35f0233ef5db4"),
    _dllm("llada2", "modeling_llada2_moe.py", DLLM_LLADA2, _PATCHED_LLADA,
          "7214e847ed65e3e904c9f82d608f033d48453235452453531d6563bfb43ea174"),
    _dllm("llada2", "configuration_llada2_moe.py", DLLM_LLADA2, _PATCHED_LLADA,
          "375a2116aa72aae697fe240486abe1363927f68fa355c744ef4270fa1cec52c3"),
)


def without_dllm_mask_block(text: str) -> str:
    """``text`` (dllm's ``modeling_dream.py``) without the lines from the one holding
    :data:`DLLM_BLOCK_START` up to, not including, the one holding :data:`DLLM_BLOCK_END`.

    A ValueError when either line is missing, occurs more than once, or they come in the wrong order
    (the file is then not the one recorded).
    """
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if DLLM_BLOCK_START in line]
    ends = [i for i, line in enumerate(lines) if DLLM_BLOCK_END in line]
    if len(starts) != 1 or len(ends) != 1 or ends[0] <= starts[0]:
        raise ValueError(f"text: expected one line holding {DLLM_BLOCK_START!r} followed by one holding "
                         f"{DLLM_BLOCK_END!r}; found {len(starts)} and {len(ends)}")
    return "".join(lines[:starts[0]] + lines[ends[0]:])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def prepared(source: Source, data: bytes) -> bytes:
    """The bytes written for ``source`` from the downloaded ``data`` (the removal applied where asked)."""
    if not source.strip_dllm_block:
        return data
    return without_dllm_mask_block(data.decode("utf-8")).encode("utf-8")


def download(url: str, timeout: float = 60.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (fixed https URLs)
        return response.read()


def fetch(destination: Path, *, accept_mismatch: bool = False, fetcher=download) -> list[str]:
    """Download every :data:`SOURCES` file into ``destination/<folder>/<name>``.

    A file whose hash differs from the recorded one is not written (a ValueError listing them after all
    downloads) unless ``accept_mismatch``. ``fetcher(url) -> bytes`` is the download function. Returns the
    written paths, relative to ``destination``.
    """
    written, mismatched = [], []
    for source in SOURCES:
        data = prepared(source, fetcher(source.url))
        if sha256(data) != source.sha256:
            mismatched.append(f"{source.folder}/{source.name} from {source.url}: sha256 {sha256(data)}, "
                              f"recorded {source.sha256}")
            if not accept_mismatch:
                continue
        target = destination / source.folder / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        written.append(f"{source.folder}/{source.name}")
    if mismatched and not accept_mismatch:
        raise ValueError("files differ from the recorded ones (not written; --accept-mismatch writes them): "
                         + "; ".join(mismatched))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("destination", type=Path, help="the folder to write (e.g. ../shared/released-models)")
    parser.add_argument("--accept-mismatch", action="store_true",
                        help="write files whose SHA-256 differs from the recorded one")
    args = parser.parse_args(argv)
    for path in fetch(args.destination, accept_mismatch=args.accept_mismatch):
        print(args.destination / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
