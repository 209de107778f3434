"""The README's five-minute tour runs as written: its shell blocks, in order, as one bash script, against
the embedded default, from a folder holding ``.venv`` (this environment) and ``photos/`` (a few COCO-mini
photos standing in for the reader's own). Only the port changes (a free one for 8000), and the first
start's starter bundles come from the run's one build of them (``embedded_starters``) rather than being
made again; the demo index and the caption bank are made by the server's own first start."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from paraseek.loadtests.net import free_port

ROOT = Path(__file__).resolve().parents[1]
TOUR_HEADING = "## A five-minute tour"


def tour_blocks(readme: str) -> list[str]:
    """The ```bash blocks between the tour's heading and the next second-level heading."""
    start = readme.index(TOUR_HEADING)
    end = readme.find("\n## ", start + len(TOUR_HEADING))
    section = readme[start:end if end != -1 else None]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_the_tour_has_each_step_the_readme_promises():
    blocks = tour_blocks((ROOT / "README.md").read_text())
    script = "\n".join(blocks)
    assert len(blocks) == 5
    for step in ("paraseek serve", "/v1/search", '"consistency": {"auto": 3}', "paraseek index build photos",
                 "paraseek admin reindex", "paraseek bench load", "--with-prometheus"):
        assert step in script, step


def test_readme_tour_runs_against_the_embedded_default(tmp_path, embedded_starters, shared_data):
    work = tmp_path / "checkout"
    (work / "photos").mkdir(parents=True)
    (work / ".venv").symlink_to(Path(sys.prefix))
    photos = sorted((shared_data / "coco-mini" / "val2017").glob("*.jpg"))[:12]
    for photo in photos:
        shutil.copy(photo, work / "photos" / photo.name)
    (work / "photos" / "broken.jpg").write_bytes(b"not a photo")  # reported and skipped, not fatal
    home = tmp_path / "home"
    shutil.copytree(embedded_starters, home / "bundles")

    port = free_port()
    script = "set -euo pipefail\n" + "\n".join(tour_blocks((ROOT / "README.md").read_text())).replace("8000", str(port))
    # a clean environment as a reader's shell has it: no variables of the test run's own but a home
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PARASEEK_HOME": str(home), "LANG": "C.UTF-8"}
    proc = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-5000:])

    # the two curl answers: a search, then a search with its consistency report
    # (curl prints no newline after a body: the two bodies and the next command's output share lines)
    decoder, answers, at = json.JSONDecoder(), [], out.find('{"results"')
    while at != -1 and len(answers) < 2:
        answer, end = decoder.raw_decode(out, at)
        answers.append(answer)
        at = out.find('{"results"', end)
    search, consistency = answers
    assert len(search["results"]) == 3 and all("id" in r and "score" in r for r in search["results"])
    report = consistency["consistency"]
    assert report["requested"] == 3 and report["produced"] >= 1
    assert all(0 <= p["ao"] <= 1 and 0 <= p["js"] <= 1 for p in report["paraphrases"])
    # the CLI search of the new snapshot names images of the photo folder
    names = {p.stem.lstrip("0") for p in photos}
    assert any(name in out for name in names)
    assert (work / "snapshots" / "mine").is_dir()
    # the load run under the reindex: its report, with the server's series beside the client's
    report_html = work / "load-report" / "load-report.html"
    assert report_html.is_file() and report_html.stat().st_size > 10_000
    summary = json.loads((work / "load-report" / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["failures"] == 0
