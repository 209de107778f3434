"""The ``paraseek`` command line. Subcommands are grouped by what they work on.

torch is imported only by ``models`` commands that export (they import ``training``); index and
search commands run on onnxruntime and faiss.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from paraseek.paths import default_bundle, default_snapshot

app = typer.Typer(help=__doc__.splitlines()[0], no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Build, export, quantise and inspect model bundles.", no_args_is_help=True)
index_app = typer.Typer(help="Build, update, inspect and search index snapshots.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (print side-by-side ratios measured in one run).", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(index_app, name="index")
app.add_typer(bench_app, name="bench")

console = Console()
err = Console(stderr=True)


def user_errors(fn):
    """Turn the errors a user can cause into a one-line message and exit code 2 (no traceback)."""
    from index.builder import BuildError
    from index.snapshot import SnapshotError
    from index.sources import SourceError
    from paraseek.bundle import BundleError
    from paraseek.paraphrase import SourceUnavailable

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (BundleError, SnapshotError, SourceError, BuildError, SourceUnavailable, FileNotFoundError, ValueError) as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)

    return wrapper


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level.")):
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


# -- models -----------------------------------------------------------------------------------
def _quantize(out: Path, int8: bool) -> None:
    if int8:
        from paraseek.demo import demo_captions
        from training.backend.quantize import quantize_text_tower

        spec = quantize_text_tower(out, demo_captions())
        console.print(f"int8 text tower: cosine vs fp32 mean {spec.cosine_vs_fp32_mean:.4f}, min {spec.cosine_vs_fp32_min:.4f}")


@models_app.command("build-starter")
@user_errors
def build_starter_cmd(
    out: Path = typer.Option(None, help="Bundle directory (default: $PARASEEK_HOME/bundles/starter)."),
    int8: bool = typer.Option(True, help="Also write the int8 text tower."),
):
    """Build the offline starter dual encoder (MiniLM text + EfficientNet-Lite0 image) as a bundle."""
    from training.backend.starter import build_starter

    out = out or default_bundle()
    manifest = build_starter(out, int8=int8)
    console.print(f"starter bundle written to {out} (dim {manifest.embedding_dim}, image_space {manifest.image_space})")


@models_app.command("export-openclip")
@user_errors
def export_openclip_cmd(
    model: str = typer.Argument("", help="open_clip model name, e.g. ViT-B-32 (or empty with --model-config)."),
    out: Path = typer.Option(..., help="Bundle directory to write."),
    pretrained: Optional[str] = typer.Option(None, help="open_clip pretrained tag or a local checkpoint file."),
    model_config: Optional[Path] = typer.Option(None, help="JSON architecture config (registered under its file stem)."),
    image_space: Optional[str] = typer.Option(None, help="Override the image-space id (keep it for text-only fine-tunes)."),
    no_image: bool = typer.Option(False, "--no-image", help="Export the text tower only."),
    int8: bool = typer.Option(False, help="Also write an int8 text tower and report its agreement."),
    name: Optional[str] = typer.Option(None),
    version: str = typer.Option("1"),
):
    """Export an open_clip model (both towers) to a bundle."""
    from training.backend.openclip import export_open_clip

    if not model and model_config is None:
        raise ValueError("give an open_clip model name or --model-config")
    manifest = export_open_clip(
        model, out, pretrained=pretrained, model_config=model_config, name=name, version=version,
        image_space=image_space, include_image=not no_image,
    )
    _quantize(out, int8)
    console.print(f"bundle {manifest.name} written to {out} (image_space {manifest.image_space})")


@models_app.command("export-hf")
@user_errors
def export_hf_cmd(
    model_dir: Path = typer.Argument(..., help="Local Hugging Face sentence-encoder directory."),
    out: Path = typer.Option(..., help="Bundle directory to write."),
    image_space: Optional[str] = typer.Option(None, help="Image-space id the encoder is aligned to."),
    int8: bool = typer.Option(False, help="Also write an int8 text tower."),
    name: Optional[str] = typer.Option(None),
    version: str = typer.Option("1"),
):
    """Export a Hugging Face sentence encoder (mean pooling) to a text bundle."""
    from training.backend.hf_text import export_hf_text

    manifest = export_hf_text(model_dir, out, name=name, version=version, image_space=image_space)
    _quantize(out, int8)
    console.print(f"bundle {manifest.name} written to {out}")


@models_app.command("info")
@user_errors
def models_info_cmd(bundle: Path = typer.Argument(None, help="Bundle directory (default: the starter).")):
    """Verify a bundle's checksums and print its manifest."""
    from paraseek.bundle import read_manifest

    manifest = read_manifest(bundle or default_bundle())
    console.print_json(manifest.model_dump_json())


# -- index ------------------------------------------------------------------------------------
def _encoder(bundle: Path | None, threads: int | None = None, precision: str = "fp32"):
    from paraseek.encoder import Encoder

    return Encoder(bundle or default_bundle(), threads=threads, precision=precision)


@index_app.command("build")
@user_errors
def index_build_cmd(
    source: Path = typer.Argument(..., help="Image folder, or a COCO-format captions/instances JSON."),
    bundle: Optional[Path] = typer.Option(None, help="Bundle with an image tower (default: the starter)."),
    out: Optional[Path] = typer.Option(None, help="Snapshot root (default: $PARASEEK_HOME/snapshots/demo)."),
    images: Optional[Path] = typer.Option(None, help="Image folder of a COCO JSON (default: beside it)."),
    index_type: str = typer.Option("auto", "--type", help="auto | flat | hnsw | ivf_flat | ivf_pq"),
    params: Optional[str] = typer.Option(None, help='Index parameters as JSON, e.g. \'{"hnsw_m": 32, "ef_search": 64}\'.'),
    batch_size: int = typer.Option(32, min=1),
    workers: Optional[int] = typer.Option(None, min=1, help="Decoding threads."),
):
    """Embed a source into a new snapshot version and publish it."""
    from index.builder import build_snapshot
    from index.faiss_index import IndexSpec

    spec = IndexSpec.model_validate({"type": index_type, **(json.loads(params) if params else {})})
    result = build_snapshot(
        source, _encoder(bundle), out or default_snapshot(), spec=spec, image_root=images,
        batch_size=batch_size, workers=workers,
    )
    m = result.manifest
    console.print(
        f"published {m.version}: {m.count} images, index {m.index.type}, "
        f"{result.images_per_second:.1f} images/s" + (f", recall@10 {m.recall_at_10:.3f}" if m.recall_at_10 is not None else "")
    )
    for item in result.skipped:
        err.print(f"skipped {item['path']}: {item['error']}", highlight=False)


@index_app.command("update")
@user_errors
def index_update_cmd(
    root: Path = typer.Argument(..., help="Snapshot root."),
    bundle: Optional[Path] = typer.Option(None),
    add: Optional[Path] = typer.Option(None, help="Image folder or COCO JSON to add."),
    remove: List[int] = typer.Option([], help="Image id to remove (repeatable)."),
    retrain: bool = typer.Option(False, help="Re-train IVF quantisers on the new contents."),
):
    """Add/remove images: a new snapshot version, the old one untouched."""
    from index.builder import update_snapshot

    if add is None and not remove and not retrain:
        raise ValueError("nothing to do: give --add, --remove or --retrain")
    result = update_snapshot(root, _encoder(bundle), add=add, remove=remove, retrain=retrain)
    console.print(f"published {result.manifest.version} (parent {result.manifest.parent}): {result.manifest.count} images")


@index_app.command("info")
@user_errors
def index_info_cmd(root: Path = typer.Argument(None, help="Snapshot root or version directory.")):
    """Print a snapshot's manifest."""
    from index.snapshot import read_snapshot_manifest, resolve

    console.print_json(read_snapshot_manifest(resolve(root or default_snapshot())).model_dump_json())


def _print_results(query: str, hits) -> None:
    table = Table(title=f"“{query}”", title_justify="left")
    for col in ("rank", "score", "id", "image", "caption"):
        table.add_column(col)
    for hit in hits:
        caps = hit.metadata.get("captions") or [""]
        table.add_row(str(hit.rank), f"{hit.score:.3f}", str(hit.id), hit.metadata["path"], caps[0])
    console.print(table)


@index_app.command("search")
@user_errors
def index_search_cmd(
    queries: List[str] = typer.Argument(..., help="One or more text queries."),
    root: Optional[Path] = typer.Option(None, "--snapshot", help="Snapshot root (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    k: int = typer.Option(5, "--k", "-k", min=1, max=1000, help="Results per query."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
):
    """Search a snapshot with text queries from the command line."""
    from index.snapshot import Snapshot

    enc = _encoder(bundle, threads=1)
    snap = Snapshot.load(root or default_snapshot(), image_space=enc.image_space, threads=1)
    results = snap.search(enc.encode_text(queries), k)
    if as_json:
        console.print_json(json.dumps([
            {"query": q, "results": [{"id": h.id, "score": h.score, "rank": h.rank, "path": h.metadata["path"]} for h in hits]}
            for q, hits in zip(queries, results)
        ]))
        return
    for q, hits in zip(queries, results):
        _print_results(q, hits)


# -- the embedded default ----------------------------------------------------------------------
def ensure_embedded_default(rebuild: bool = False) -> tuple[Path, Path]:
    """The starter bundle and the demo-gallery snapshot under $PARASEEK_HOME, built if missing."""
    from index.builder import build_snapshot
    from index.snapshot import current_version
    from paraseek.demo import CAPTIONS_FILE, GALLERY_DIR

    bundle, snap_root = default_bundle(), default_snapshot()
    if rebuild or not (bundle / "manifest.json").is_file():
        from training.backend.starter import build_starter

        err.print(f"building the starter bundle in {bundle} ...")
        build_starter(bundle)
    if rebuild or current_version(snap_root) is None:
        err.print(f"indexing the demo gallery into {snap_root} ...")
        build_snapshot(CAPTIONS_FILE, _encoder(bundle), snap_root, image_root=GALLERY_DIR)
    return bundle, snap_root


@app.command("serve")
@user_errors
def serve_cmd(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, min=1, max=65535),
):
    """Run the HTTP service; settings come from PARASEEK_* variables (PARASEEK_BUNDLE,
    PARASEEK_SNAPSHOT, PARASEEK_REDIS_URL, PARASEEK_ADMIN_TOKEN, ...).

    Without PARASEEK_BUNDLE/PARASEEK_SNAPSHOT it serves the embedded default (starter bundle + demo
    gallery), building them on first use.
    """
    from service.main import run
    from service.settings import Settings

    if not os.environ.get("PARASEEK_BUNDLE") and not os.environ.get("PARASEEK_SNAPSHOT"):
        ensure_embedded_default()
    run(host=host, port=port, settings=Settings())

DEMO_QUERIES = ["a dog playing outside", "people riding bikes in a city street", "a plate of food on a table"]


@app.command("demo")
@user_errors
def demo_cmd(
    queries: Optional[List[str]] = typer.Argument(None, help="Queries (default: three examples)."),
    k: int = typer.Option(3, "--k", "-k", min=1, max=76, help="Results per query."),
    rebuild: bool = typer.Option(False, help="Rebuild the starter bundle and the demo index."),
):
    """The embedded default: starter bundle + the bundled 76-photo COCO gallery, searched from the CLI.

    Builds the starter bundle and the demo index on first use (about a minute), then answers.
    """
    from index.snapshot import Snapshot

    bundle, snap_root = ensure_embedded_default(rebuild)
    enc = _encoder(bundle, threads=1)
    snap = Snapshot.load(snap_root, image_space=enc.image_space, threads=1)
    queries = queries or DEMO_QUERIES
    for q, hits in zip(queries, snap.search(enc.encode_text(queries), k)):
        _print_results(q, hits)


# -- train ------------------------------------------------------------------------------------
@app.command("train")
@user_errors
def train_cmd(
    recipe: str = typer.Argument(None, help="Recipe YAML file, or the name of a built-in recipe."),
    set_: List[str] = typer.Option([], "--set", help="Override a field: train.lr=1e-5 (repeatable)."),
    output: Optional[Path] = typer.Option(None, help="Run directory (default: the recipe's output or runs/<name>)."),
    max_steps: Optional[int] = typer.Option(None, min=1, help="Stop after this many steps (resume later)."),
    list_: bool = typer.Option(False, "--list", help="List the built-in recipes."),
):
    """Train a text encoder from a recipe; resumes from the run directory's checkpoint; exports a bundle.

    Multi-GPU: torchrun --nproc-per-node N -m paraseek.cli train RECIPE
    """
    from training.recipe import RecipeError, list_recipes, load_recipe

    if list_ or recipe is None:
        console.print("\n".join(list_recipes()))
        return
    try:
        spec = load_recipe(recipe, set_)
    except RecipeError as exc:
        raise ValueError(str(exc)) from exc
    from training.trainer import train

    result = train(spec, output, max_steps=max_steps)
    console.print(f"{result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}; run in {result.run_dir}")
    if (result.bundle / "manifest.json").is_file():
        console.print(f"bundle: {result.bundle}")


# -- eval -------------------------------------------------------------------------------------
eval_app = typer.Typer(help="Evaluate bundles: paraphrase consistency, retrieval, STS, perturbations.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


def _expander(spec: Optional[str], ppdb: Optional[Path]):
    """'wordnet:3' / 'ppdb:2' -> (label, text -> expansions)."""
    if not spec:
        return None
    method, _, n = spec.partition(":")
    n = int(n or 3)
    if method == "wordnet":
        from paraseek.paraphrase.wordnet import WordNetSource

        source = WordNetSource()
    elif method == "ppdb":
        from paraseek.paraphrase.ppdb import PPDBSource

        source = PPDBSource(ppdb)
    else:
        raise ValueError(f"--expansion {spec!r}: method must be wordnet or ppdb (LLM expansion runs through the service)")
    return f"{method}{n}", lambda text: source.paraphrases(text, n)


def _load_pair(bundle: Path | None, snapshot: Path | None):
    from index.snapshot import Snapshot

    enc = _encoder(bundle)
    return enc, Snapshot.load(snapshot or default_snapshot(), image_space=enc.image_space)


@eval_app.command("paraphrase")
@user_errors
def eval_paraphrase_cmd(
    pairs: Path = typer.Option(..., help="TSV of (query, paraphrase) pairs, e.g. CxC caption1/caption2."),
    snapshot: Optional[Path] = typer.Option(None, help="Snapshot root (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    k: int = typer.Option(10, "--k", "-k", min=1, max=1000),
    expansion: Optional[str] = typer.Option(None, help="Also evaluate with query expansion: wordnet:N or ppdb:N."),
    ppdb: Optional[Path] = typer.Option(None, envvar="PARASEEK_PPDB_PATH", help="PPDB TSV for ppdb expansion."),
    out: Optional[Path] = typer.Option(None, help="Folder for per-pair CSV and summary JSON."),
):
    """AO@k and JS@k between the top-k lists of each query and its paraphrase."""
    from paraseek.evaluation.data import read_pairs
    from paraseek.evaluation.paraphrase import evaluate_pairs, write_pairs_csv

    text_pairs = read_pairs(pairs)
    enc, snap = _load_pair(bundle, snapshot)
    results = [evaluate_pairs(enc, snap, text_pairs, k=k)]
    exp = _expander(expansion, ppdb)
    if exp:
        results.append(evaluate_pairs(enc, snap, text_pairs, k=k, expand=exp[1], label=exp[0]))
    summary = {r.label: r.summary() for r in results}
    if out:
        write_pairs_csv(out / "pairs.csv", text_pairs, results)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print_json(json.dumps(summary))


@eval_app.command("retrieval")
@user_errors
def eval_retrieval_cmd(
    snapshot: Optional[Path] = typer.Option(None, help="Snapshot built from a COCO captions file (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    features: Optional[Path] = typer.Option(None, help="Precomputed (2, N, D) .npy: [0] images, [1] their captions."),
):
    """Text-to-image and image-to-text R@1/5/10 and RSUM."""
    import numpy as np

    from paraseek.evaluation.retrieval import cross_modal_recall
    from paraseek.evaluation.suite import retrieval_on_snapshot

    if features is not None:
        arr = np.load(features)
        if arr.ndim != 3 or arr.shape[0] != 2:
            raise ValueError(f"{features}: expected shape (2, N, D), got {arr.shape}")
        ids = list(range(arr.shape[1]))
        result = cross_modal_recall(arr[0], ids, arr[1], ids)
    else:
        result = retrieval_on_snapshot(*_load_pair(bundle, snapshot))
    console.print_json(json.dumps(result))


@eval_app.command("sts")
@user_errors
def eval_sts_cmd(
    file: Path = typer.Option(..., help="STS-B format: genre, file, year, id, score, sentence1, sentence2."),
    bundle: Optional[Path] = typer.Option(None),
):
    """Spearman and Pearson of cosine similarity against gold scores."""
    from paraseek.evaluation.data import read_sts
    from paraseek.evaluation.sts import evaluate_sts

    pairs = read_sts(file)  # check the data before loading the model
    console.print_json(json.dumps(evaluate_sts(_encoder(bundle), pairs)))


@eval_app.command("perturb")
@user_errors
def eval_perturb_cmd(
    snapshot: Optional[Path] = typer.Option(None, help="Snapshot with captions (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    seed: int = typer.Option(0),
    out: Optional[Path] = typer.Option(None, help="Write the report as JSON here."),
):
    """Retrieval on clean vs perturbed captions (character and word level), with relative drops."""
    from paraseek.evaluation.suite import perturbation_suite
    from paraseek.paraphrase import SourceUnavailable

    try:
        from paraseek.paraphrase.wordnet import WordNetSource

        wordnet = WordNetSource()
    except SourceUnavailable as exc:
        err.print(f"synonym perturbation skipped: {exc}")
        wordnet = None
    report = perturbation_suite(*_load_pair(bundle, snapshot), wordnet_source=wordnet, seed=seed)
    table = Table(title="perturbation robustness (text-to-image)")
    for col in ("perturbation", "R@1", "R@5", "R@10", "drop R@1", "AO@10 vs clean"):
        table.add_column(col)
    for name, r in report.items():
        table.add_row(name, f"{r['t2i_r1']:.1f}", f"{r['t2i_r5']:.1f}", f"{r['t2i_r10']:.1f}",
                      f"{r.get('relative_drop_r1', 0):.1%}", f"{r.get('ao@10_vs_clean', 1):.3f}")
    console.print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))


@eval_app.command("compare")
@user_errors
def eval_compare_cmd(
    model: List[str] = typer.Option(..., help="NAME=BUNDLE or NAME=BUNDLE@SNAPSHOT (repeatable)."),
    out: Path = typer.Option(Path("eval-report"), help="Folder for results.md/json and plots."),
    pairs: Optional[Path] = typer.Option(None, help="Paraphrase pairs TSV."),
    sts: Optional[Path] = typer.Option(None, help="STS-B file."),
    images: Optional[Path] = typer.Option(None, help="COCO captions JSON to index models given without a snapshot."),
    image_root: Optional[Path] = typer.Option(None, help="Image folder of --images."),
    k: int = typer.Option(10, "--k", "-k", min=1, max=1000),
):
    """The suite over several bundles: a Markdown/JSON table (rows = models) plus PNG plots."""
    from paraseek.evaluation.data import read_pairs, read_sts
    from paraseek.evaluation.suite import compare, parse_model

    rows = compare([parse_model(m) for m in model], out, pairs=read_pairs(pairs) if pairs else None,
                   sts=read_sts(sts) if sts else None, images=images, image_root=image_root, k=k)
    console.print((out / "results.md").read_text())
    console.print(f"written to {out} ({len(rows)} models)")


# -- bench ------------------------------------------------------------------------------------
@bench_app.command("encoder")
def bench_encoder_cmd(
    repeats: int = typer.Option(30, min=3, help="Timed runs per configuration (median reported)."),
    workdir: Optional[Path] = typer.Option(None, help="Where to export the benchmark bundles."),
    threads: int = typer.Option(0, help="onnxruntime/torch threads (0: all cores)."),
):
    """torch eager (77 tokens) vs bundle runtime (fp32/int8, truncated), batch 1 and 32."""
    from loadtests.bench_encoder import run

    sys.exit(run(repeats=repeats, workdir=workdir, threads=threads or None))


@bench_app.command("index", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_index_cmd(ctx: typer.Context):
    """Build throughput; flat/HNSW/IVF latency, QPS and recall at 10K-1M (options: --sizes, --kinds, --data)."""
    from loadtests.bench_index import main as bench

    sys.exit(bench(ctx.args))


@bench_app.command("service", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_service_cmd(ctx: typer.Context):
    """End-to-end latency/throughput at concurrency 1 and 32, micro-batching on vs off (options: --seconds)."""
    from loadtests.bench_service import main as bench

    sys.exit(bench(ctx.args))


@bench_app.command("load")
@user_errors
def bench_load_cmd(
    url: str = typer.Option("http://127.0.0.1:8000", help="A running paraseek service (nothing is started)."),
    users: int = typer.Option(20, min=1),
    spawn_rate: float = typer.Option(5.0, min=0.1),
    duration: int = typer.Option(30, min=1, help="Seconds."),
    tags: List[str] = typer.Option([], "--tag", help="Only these scenarios (plain, cache, consistency, expansion, batch, info)."),
    out: Path = typer.Option(Path("loadtest-report"), help="Folder for the CSV/HTML reports and summary.json."),
    max_failure_ratio: float = typer.Option(0.0, min=0.0, max=1.0),
    slo_p99_ms: Optional[float] = typer.Option(None, help="Fail if the aggregated p99 is above this."),
    slo_p50_ms: Optional[float] = typer.Option(None, help="Fail if the aggregated p50 is above this."),
    queries: Optional[Path] = typer.Option(None, help="TSV of image_id/caption to draw queries from."),
):
    """Run Locust headless against a running service; non-zero exit on failures or a missed SLO."""
    import httpx

    from loadtests.load import run_load

    try:
        httpx.get(url.rstrip("/") + "/healthz", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"no paraseek service answers at {url}: {exc}") from exc
    s = run_load(url, users=users, spawn_rate=spawn_rate, duration_s=duration, out=out, tags=tags or None,
                 max_failure_ratio=max_failure_ratio, slo_p99_ms=slo_p99_ms, slo_p50_ms=slo_p50_ms, queries=queries)
    console.print(f"{s.requests} requests, {s.failures} failures ({s.failure_ratio:.2%}), {s.rps:.1f} req/s; "
                  f"p50 {s.p50_ms:.0f} ms, p95 {s.p95_ms:.0f} ms, p99 {s.p99_ms:.0f} ms")
    console.print(f"HTML report: {s.html_report}")
    for v in s.violations:
        err.print(f"[red]violation:[/red] {v}")
    raise typer.Exit(1 if s.violations else 0)


if __name__ == "__main__":
    app()
