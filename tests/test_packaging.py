"""What a user of the package sees before running it: metadata, changelog, install instructions,
and what the sdist carries. Fast and offline: no build here (tools/check_dist.sh builds the
sdist and the wheel and installs the wheel into a fresh virtualenv)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest

import dgemma_sampler

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
# Folders that only the repository carries: the sdist ships none of them.
REPO_ONLY = ("tests", "bench", "tools", "scripts", "docs", ".ci")


@pytest.fixture(scope="module")
def project():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_project_urls(project):
    urls = project.get("urls", {})
    for key in ("Homepage", "Repository", "Issues", "Changelog"):
        assert key in urls, f"[project.urls] lacks {key}"
    hosts = set()
    for key, url in urls.items():
        parsed = urlparse(url)
        assert parsed.scheme == "https" and parsed.netloc, f"[project.urls] {key} is not a URL: {url}"
        hosts.add(parsed.netloc)
    # One host everywhere, so that settling the repository's address is one replacement.
    assert len(hosts) == 1, hosts
    assert urls["Changelog"].endswith("/CHANGELOG.md")


def test_classifiers(project):
    classifiers = project.get("classifiers", [])
    for prefix in ("Development Status :: ", "Intended Audience :: ", "Operating System :: ",
                   "Topic :: ", "Environment :: GPU :: NVIDIA CUDA"):
        assert any(c.startswith(prefix) for c in classifiers), f"no classifier {prefix!r}"
    # The Python versions claimed are the ones requires-python allows.
    assert project["requires-python"] == ">=3.10"
    minors = sorted(int(m) for c in classifiers
                    for m in re.findall(r"^Programming Language :: Python :: 3\.(\d+)$", c))
    assert minors and minors[0] == 10, minors
    # setuptools >= 77 refuses a License classifier beside a license expression.
    assert project["license"] == "Apache-2.0"
    assert not any(c.startswith("License :: ") for c in classifiers)
    assert project.get("keywords")


def test_vllm_entry_point(project):
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"dgemma_sampler": "dgemma_sampler.vllm.plugin:register"}


def test_changelog_has_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[?([^\]\s]+)\]?", text, flags=re.M)
    assert headings and headings[0] == "Unreleased", headings
    assert dgemma_sampler.__version__ in headings, (dgemma_sampler.__version__, headings)


def _pip_install_commands(text):
    """The arguments of every `pip install` in ``text``, up to a comment or the command's end."""
    for match in re.finditer(r"pip install\b([^\n`#]*)", text):
        try:
            yield shlex.split(match.group(1))
        except ValueError:  # an unbalanced quote: a sentence, not a command
            continue


def index_installs(text):
    """`pip install` commands that take dgemma-sampler from a package index (no URL, no file)."""
    name = re.compile(r"^dgemma[-_.]sampler(\[[^\]]*\])?\s*((==|>=|~=|<=|<|>)\S*)?$", re.I)
    found = []
    for args in _pip_install_commands(text):
        for i, arg in enumerate(args):
            if name.match(arg) and not (i + 1 < len(args) and args[i + 1] == "@"):
                found.append(" ".join(args))
    return found


def test_index_install_detector():
    assert index_installs("pip install 'dgemma-sampler[vllm]'  # x")
    assert index_installs("`pip install -U dgemma_sampler==0.1.0`")
    assert not index_installs("pip install 'dgemma-sampler[vllm] @ git+https://h/dgemma-sampler.git'")
    assert not index_installs("pip install dgemma-sampler[vllm] @ git+https://h/dgemma-sampler.git")
    assert not index_installs("pip install -e '.[vllm]'\npip install dist/dgemma_sampler-*.whl")


def test_readme_installs_nothing_from_an_index():
    # dgemma-sampler is on no package index: the README installs it from a checkout, a wheel or a
    # git URL. Publish it first, then lift this test.
    text = (ROOT / "README.md").read_text()
    assert index_installs(text) == []
    assert "pip install -e '.[vllm]'" in text
    assert "git+https://" in text
    assert "dist/dgemma_sampler-" in text


def _manifest_lines():
    lines = []
    for raw in (ROOT / "MANIFEST.in").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def test_manifest_prunes_repository_only_folders():
    lines = _manifest_lines()
    for folder in REPO_ONLY:
        assert f"prune {folder}" in lines, f"MANIFEST.in does not prune {folder}/"
        # Nothing after the prune brings files of that folder back.
        after = lines[lines.index(f"prune {folder}") + 1:]
        assert not [line for line in after
                    if any(word == folder or word.startswith(folder + "/") for word in line.split()[1:])]


def _repo_files():
    skip = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if d not in skip and not d.startswith(".venv") and not d.endswith(".egg-info")]
        for name in filenames:
            yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def test_sdist_file_list(monkeypatch):
    """MANIFEST.in applied as setuptools applies it: starting from every file of the repository
    (setuptools' defaults add tests/test*.py, and a stale SOURCES.txt may add anything), the
    repository-only folders are gone; starting from nothing, CHANGELOG.md is added."""
    egg_info = pytest.importorskip("setuptools.command.egg_info")
    monkeypatch.chdir(ROOT)  # setuptools' include patterns glob from the working directory

    def apply(start):
        file_list = egg_info.FileList()
        file_list.files = list(start)
        for line in _manifest_lines():
            file_list.process_template_line(line)
        return {Path(f).as_posix() for f in file_list.files}

    shipped = apply(_repo_files())
    for folder in REPO_ONLY:
        assert not [f for f in shipped if f.startswith(folder + "/")], folder
    for kept in ("README.md", "LICENSE", "pyproject.toml", "dgemma_sampler/__init__.py",
                 "dgemma_sampler/py.typed", "kernels/contract.py"):
        assert kept in shipped, kept
    assert "CHANGELOG.md" in apply([])
