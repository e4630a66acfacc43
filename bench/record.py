"""The bench of record: each benchmark's latest result per card, and one history of all runs.

A benchmark run with its default output writes, under ``bench/results/``:

* ``<bench>-<card>.json``: ``meta`` (what produced it: commit, card, torch / triton / Python
  versions, UTC date, command line) and the benchmark's own results;
* ``<bench>-<card>.log``: what it printed, headed by the same facts (``Record`` tees stdout);
* one line appended to ``history.jsonl``: the ``meta`` fields, the benchmark's name and its
  headline ``figures`` (a few numbers per shape, small enough to keep every run).

A run given another ``--out`` writes its JSON and log there and leaves the record alone, so
ad-hoc and test runs never enter the history. So does a run without a GPU (speed is not
measured on a CPU): its default output goes to ``<temp dir>/dgemma-sampler-bench/``. The card
tag is the first word of the device name that holds a digit (``NVIDIA H200`` -> ``h200``), or
``cpu``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
HISTORY = RESULTS / "history.jsonl"
ROOT = RESULTS.parents[1]


def commit() -> str:
    """Short id of the checked-out commit, ``+dirty`` when tracked files differ from it, or
    ``unknown`` outside a git checkout. ``DGEMMA_BENCH_COMMIT`` names it where the tree is a
    copy without its git history (a lent GPU machine)."""
    if os.environ.get("DGEMMA_BENCH_COMMIT"):
        return os.environ["DGEMMA_BENCH_COMMIT"]
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "") if sha else "unknown"


def card_name(device: torch.device | None = None) -> str:
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return torch.cuda.get_device_name(device)
    return "cpu"


def card_tag(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``; ``cpu`` -> ``cpu``."""
    words = re.findall(r"[A-Za-z0-9]+", name)
    for word in words:
        if any(c.isdigit() for c in word):
            return word.lower()
    return "-".join(w.lower() for w in words) or "unknown"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def meta(device: torch.device | None = None, **extra) -> dict:
    """What produced a result: commit, card, versions, UTC date and command line."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT) if sys.argv and sys.argv[0] else "?"
    return dict(commit=commit(), card=card_name(device), torch=torch.__version__,
                triton=_version("triton"), python=platform.python_version(),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(["python", script, *sys.argv[1:]]), **extra)


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self):
        return False


class Record:
    """One benchmark run's place in the record.

    ``with Record("step", out) as rec: ...; rec.save(results, figures)``. ``out``: a JSON path
    chosen by the user, or None for the record's own ``bench/results/<bench>-<card>.json``
    (then the run is also appended to ``history.jsonl``). Stdout is copied into the log beside
    the JSON while the block runs.
    """

    def __init__(self, bench: str, out: str | os.PathLike | None = None,
                 device: torch.device | None = None, history: Path | None = None):
        self.bench = bench
        self.meta = meta(device)
        tag = card_tag(self.meta["card"])
        self.of_record = out is None and tag != "cpu"
        if out is None:
            folder = RESULTS if self.of_record else Path(tempfile.gettempdir()) / "dgemma-sampler-bench"
            out = folder / f"{bench}-{tag}.json"
        self.json_path = Path(out)
        self.log_path = self.json_path.with_suffix(".log")
        self.history = history
        self._log = None
        self._stdout = None

    def path(self, suffix: str) -> Path:
        """A file beside the JSON (``.png`` for a plot)."""
        return self.json_path.with_suffix(suffix)

    def __enter__(self) -> Record:
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        m = self.meta
        self._log.write(f"# {m['card']} (torch {m['torch']}, triton {m['triton']}), {m['date']}, "
                        f"commit {m['commit']}. Command: {m['command']}\n")
        self._stdout = sys.stdout
        sys.stdout = _Tee(self._stdout, self._log)
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout = self._stdout
        self._log.close()

    def save(self, results: dict, figures) -> Path:
        """Write the JSON (``meta`` + ``results``' keys) and, for a run of record, append
        ``figures`` to the history."""
        with open(self.json_path, "w") as f:
            json.dump({"meta": self.meta, **results}, f, indent=1, default=str)
        print(f"results: {self.json_path}")
        if self.of_record:
            append_history(dict(bench=self.bench, **self.meta, figures=figures), self.history)
            print(f"history: {self.history or HISTORY}")
        return self.json_path


def append_history(row: dict, path: Path | None = None) -> None:
    path = HISTORY if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def read_history(path: Path | None = None) -> list[dict]:
    path = HISTORY if path is None else path
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pick(row: dict, keys) -> dict:
    """``row``'s entries among ``keys`` (headline figures of a result row)."""
    return {k: row[k] for k in keys if k in row}
