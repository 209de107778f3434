"""paraseek.loadtests.temporary_folder: a benchmark's scratch folder is gone once its process exits."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick


RUN = """
import sys
from pathlib import Path
from paraseek.loadtests import temporary_folder
folder = temporary_folder("paraseek-test-scratch-")
(folder / "snapshot").mkdir()
(folder / "snapshot" / "vectors.npy").write_bytes(b"x" * 4096)
print(folder, Path(folder, "snapshot", "vectors.npy").is_file(), flush=True)
if sys.argv[1] == "fail":
    raise SystemExit("the benchmark failed")
"""


def test_the_folder_is_removed_when_the_benchmark_ends_or_fails():
    for how in ("ends", "fail"):
        done = subprocess.run([sys.executable, "-c", RUN, how], capture_output=True, text=True)
        assert done.returncode == (0 if how == "ends" else 1), done.stderr
        folder, existed = done.stdout.split()
        assert existed == "True" and Path(folder).name.startswith("paraseek-test-scratch-")
        assert not Path(folder).exists(), how
