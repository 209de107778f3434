"""``paraseek index ...``: build, update, inspect and search snapshots (onnxruntime and faiss, no torch)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, List, Optional

import numpy as np
import typer
from pydantic import ValidationError
from rich.table import Table

from paraseek.core.bundle import read_manifest
from paraseek.core.cli_support import console, err, user_errors
from paraseek.core.encoder import Encoder, configured_providers
from paraseek.core.errors import UserError
from paraseek.core.settings import Settings
from paraseek.index.backends import store_from_settings
from paraseek.index.builder import (
    BuildResult,
    build_snapshot,
    build_snapshot_from_vectors,
    copy_snapshot,
    export_snapshot_vectors,
    plan_build,
    update_snapshot,
)
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.filters import SearchFilter
from paraseek.index.snapshot import Snapshot, check_image_space, read_snapshot_manifest, resolve
from paraseek.index.store import SearchHit, SnapshotStore
from paraseek.paraphrase.caption_bank import CaptionBank, configured_bank_dir
from paraseek.paraphrase.hub_table import hub_table_for

app = typer.Typer(help="Build, update, inspect and search index snapshots.", no_args_is_help=True)


def load_encoder(bundle: Path | None, threads: int | None = None, precision: str = "fp32") -> Encoder:
    """The given bundle, else the configured one (PARASEEK_BUNDLE, default: the starter)."""
    settings = Settings()
    return Encoder(bundle or settings.bundle_dir, threads=threads, precision=precision,
                   providers=configured_providers(settings.providers))


def load_snapshot(root: Path | None, encoder: Encoder, threads: int | None = None) -> Snapshot:
    """A FAISS snapshot: the given root, else the configured one (PARASEEK_SNAPSHOT, default: the demo)."""
    return Snapshot.load(root or Settings().snapshot_root, image_space=encoder.image_space, threads=threads)


BACKEND_HELP = "faiss (snapshot folders) | milvus (collections); default: PARASEEK_INDEX_BACKEND, else faiss"
URI_HELP = "Milvus URI: a .db file (Milvus Lite) or http://host:19530 (default: PARASEEK_MILVUS_URI, else Lite under PARASEEK_HOME)"
COLLECTION_HELP = "Milvus collection prefix (default: PARASEEK_MILVUS_COLLECTION, else paraseek)"


def open_cli_store(backend: str | None, root: Path | None, uri: str | None, collection: str | None) -> SnapshotStore:
    """The store a command works on: --backend with --out/--snapshot (faiss) or --uri/--collection (milvus),
    each defaulting to the settings."""
    updates: dict[str, Any] = {k: v for k, v in (("index_backend", backend), ("milvus_uri", uri), ("milvus_collection", collection)) if v}
    try:
        settings = Settings(**updates)
    except ValidationError as exc:
        raise UserError(f"--backend/--uri/--collection: {exc.errors()[0]['msg']}") from exc
    if settings.index_backend == "faiss" and (uri or collection):
        raise UserError("--uri and --collection go with --backend milvus")
    if settings.index_backend == "milvus" and root is not None:
        raise UserError("--out/--snapshot name a FAISS snapshot folder: with --backend milvus use --uri and --collection")
    return store_from_settings(settings, root)


HUB_TABLE_HELP = ("Write the new version's hub table (each image's hubness against the serving bundle's caption bank: "
                  "PARASEEK_CAPTION_BANK, else PARASEEK_BUNDLE's default bank under PARASEEK_HOME) under "
                  "PARASEEK_HUB_TABLES before publishing it, so a server whose default expansion has a hub_weight "
                  "serves it hub-corrected from its first query instead of building the table at start (about 7 "
                  "MFLOP an image). Default: when "
                  "PARASEEK_DEFAULT_EXPANSION has a hub_weight and that bank exists.")


def default_hub_weight(settings: Settings) -> float:
    """The hub_weight of the server's default expansion on these settings (0 where it has none; a malformed
    one is the server's to refuse)."""
    try:
        expansion = json.loads(settings.default_expansion or "{}")
    except json.JSONDecodeError:
        return 0.0
    weight = expansion.get("hub_weight") if isinstance(expansion, dict) else None
    return float(weight) if isinstance(weight, (int, float)) else 0.0


def serving_hub_bank(wanted: bool | None, image_space: str) -> CaptionBank | None:
    """The bank a server on these settings corrects hubness against, for a version of ``image_space``:
    ``wanted`` True (--hub-table; no such bank is an error), False (none), None (where the default expansion
    has a hub_weight and the bank exists; else a note on stderr)."""
    if wanted is False:
        return None
    settings = Settings()
    if wanted is None and not default_hub_weight(settings):
        return None
    try:
        bundle = read_manifest(settings.bundle_dir, verify=False)
        bank = CaptionBank.load(configured_bank_dir(settings, bundle), bundle)
        if bank.manifest.image_space != image_space:
            raise UserError(f"caption bank {bank.path} is in image space {bank.manifest.image_space!r}, the index in "
                            f"{image_space!r}")
    except UserError as exc:
        if wanted:
            raise UserError(f"--hub-table: {exc}") from exc
        err.print(f"no hub table written: {exc}", highlight=False)
        return None
    return bank


def write_hub_table(store: SnapshotStore, version: str, bank: CaptionBank) -> None:
    folder = Settings().hub_tables_dir
    snapshot = store.load(version, use_gpu=False)  # read, not searched
    try:
        table, seconds = hub_table_for(folder, snapshot, bank, must_write=True)
    except OSError as exc:
        raise UserError(f"hub table of {version} not written to {folder} (PARASEEK_HUB_TABLES): {exc}") from exc
    finally:
        snapshot.close()
    done = "already written" if seconds is None else f"computed in {seconds:.1f} s"
    console.print(f"hub table of {version}: {len(table)} images against {bank.path.name}, {done}", highlight=False,
                  soft_wrap=True)


def publish_with_hub_table(store: SnapshotStore, version: str, bank: CaptionBank | None) -> None:
    """Make a version written unpublished (``activate=False``) current, its hub table against ``bank`` written
    first, so no server loads the version without it. A table that cannot be written is reported, and the
    version published all the same: a server then computes the table when it loads it."""
    if bank is None:
        return  # the version was published as it was written
    try:
        write_hub_table(store, version, bank)
    except Exception as exc:
        detail = str(exc) if isinstance(exc, UserError) else f"hub table not written ({type(exc).__name__}: {exc})"
        err.print(f"{detail}; servers compute it when they load {version}", highlight=False, soft_wrap=True)
    store.activate(version)


def print_version_lines(rows: list[tuple[str, str, str, int, str, float | None, str | None]]) -> None:
    """Published versions as a table, one line each: (mark, version, created_at, images, index type,
    recall@10, parent); ``paraseek admin versions`` prints the same from the service's answer."""
    width = max((len(row[1]) for row in rows), default=7)
    marks = max((len(row[0]) for row in rows), default=1)
    lines = [f"{'':<{marks}} {'version':<{width}}  {'created (UTC)':<19}  {'images':>10}  {'index':<8}  {'recall@10':>9}  parent"]
    for mark, version, created_at, count, index_type, recall, parent in rows:
        recall_text = "" if recall is None else f"{recall:.3f}"
        lines.append(f"{mark:<{marks}} {version:<{width}}  {created_at[:19]:<19}  {count:>10}  {index_type:<8}  "
                     f"{recall_text:>9}  {parent or ''}")
    console.print("\n".join(lines), soft_wrap=True, highlight=False, markup=False)


def print_plan(plan: dict) -> None:
    """``plan_build``'s answer, as ``index build --dry-run`` says it."""
    if plan["unchanged"]:
        n = plan["undecodable"]
        undecodable = f"; {n} file{'s' if n != 1 else ''} it could not decode stay{'' if n != 1 else 's'} skipped" if n else ""
        console.print(f"dry run: nothing changed since {plan['current']} was built: it would stay current "
                      f"({plan['reuse']} images{undecodable})", soft_wrap=True, highlight=False)
    else:
        moved = f" ({plan['moved']} of them found by their bytes)" if plan["moved"] else ""
        reused = f"{plan['reuse']} vectors would be reused from {plan['current']}{moved}, " if plan["current"] else ""
        console.print(f"dry run: {plan['images_total']} images; {reused}{plan['encode']} images would be encoded into "
                      "a new version", soft_wrap=True, highlight=False)
    if plan["refused"]:
        console.print(f"{plan['refused']} files refused (links or names that lead outside the folder)", highlight=False)


def index_spec(index_type: str, params: str | None) -> IndexSpec:
    try:
        return IndexSpec.model_validate({"type": index_type, **(json.loads(params) if params else {})})
    except json.JSONDecodeError as exc:
        raise UserError(f"--params is not valid JSON: {exc}") from exc
    except ValidationError as exc:
        raise UserError(f"--type/--params: {exc}") from exc


def print_results(query: str, hits: list[SearchHit]) -> None:
    table = Table(title=f"“{query}”", title_justify="left")
    for col in ("rank", "score", "id", "image", "caption"):
        table.add_column(col)
    for hit in hits:
        caps = hit.metadata.get("captions") or [""]
        table.add_row(str(hit.rank), f"{hit.score:.3f}", str(hit.id), hit.metadata.get("path", ""), caps[0])
    console.print(table)


@app.command("build")
@user_errors
def build_cmd(
    source: Optional[Path] = typer.Argument(None, help="Image folder, or a COCO-format captions/instances JSON."),
    embeddings: Optional[Path] = typer.Option(None, help="Index precomputed vectors instead: a .npy (N, D) file, a folder "
                                              "of .npy shards, or clip-retrieval's output folder (img_emb/ + metadata/)."),
    metadata: Optional[Path] = typer.Option(None, help="With a single .npy: its metadata (.parquet, .jsonl, .csv)."),
    image_space: Optional[str] = typer.Option(None, help="With --embeddings: the image space the vectors came from "
                                              "(default: that of --bundle's image tower)."),
    normalize: bool = typer.Option(False, help="With --embeddings: L2-normalise vectors that are not (else refused)."),
    bundle: Optional[Path] = typer.Option(None, help="Bundle with an image tower (default: the starter)."),
    out: Optional[Path] = typer.Option(None, help="Snapshot root (default: $PARASEEK_HOME/snapshots/demo)."),
    images: Optional[Path] = typer.Option(None, help="Image folder of a COCO JSON (default: beside it)."),
    index_type: str = typer.Option("auto", "--type", help="auto | flat | hnsw | ivf_flat | ivf_fp16 | ivf_pq; auto: "
                                    "flat up to 200K vectors, then ivf_fp16 while its lists fit half the free memory "
                                    "(--params '{\"memory_gb\": N}' sets it), else ivf_pq with refine"),
    params: Optional[str] = typer.Option(None, help='Index parameters as JSON, e.g. \'{"hnsw_m": 32, "ef_search": 64}\'.'),
    batch_size: int = typer.Option(32, min=1),
    workers: Optional[int] = typer.Option(None, min=1, help="Decoding threads."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    target_recall: Optional[float] = typer.Option(None, min=0.0, max=1.0, help="Tune nprobe/efSearch/refine factor to "
                                                  "reach this recall@10 on text queries (captions of the images, or "
                                                  "--query-vectors), and record the setting and its held-out recall "
                                                  "(default for --type auto past 200K vectors: 0.95)."),
    query_vectors: Optional[Path] = typer.Option(None, help="With --embeddings: a .npy of text-query embeddings "
                                                 "(the aligned text tower's) to measure and tune recall on."),
    image_root: Optional[List[Path]] = typer.Option(None, help="With --embeddings: a folder the metadata's image paths "
                                                    "may point into (repeatable; relative paths are read under the "
                                                    "first; default: the embeddings' folder). The service serves "
                                                    "images from these folders only."),
    drop_outside_paths: bool = typer.Option(False, help="With --embeddings: index rows whose image path lies outside "
                                            "the image roots without that path (their url stays), instead of refusing."),
    hub_table: Optional[bool] = typer.Option(None, "--hub-table/--no-hub-table", help=HUB_TABLE_HELP),
    reuse: bool = typer.Option(True, "--reuse/--reencode", help="Take the vectors of files unchanged since the current "
                               "version indexed them (same path, size and modification time, or the same bytes under "
                               "another path; same image tower) instead of encoding them again, and keep the current "
                               "version when nothing changed at all; --reencode encodes every file into a new version."),
    checksum: bool = typer.Option(False, help="Compare photos by their bytes instead of size and modification time "
                                  "(every photo is read and hashed first): finds a file replaced by another of the same "
                                  "size and time, at the cost of reading the whole collection."),
    dry_run: bool = typer.Option(False, help="Say what the build would do (keep the current version, or how many photos "
                                 "it would reuse and encode) without encoding or writing anything."),
):
    """Embed a source (or take precomputed vectors) into a new snapshot version and publish it (an image source
    with nothing changed since the current version was built keeps that version)."""
    if (source is None) == (embeddings is None):
        raise UserError("give an image source or --embeddings PATH (one of the two)")
    if query_vectors is not None and embeddings is None:
        raise UserError("--query-vectors goes with --embeddings (image builds use the captions of the images)")
    if not reuse and embeddings is not None:
        raise UserError("--reencode goes with an image source (precomputed vectors are never encoded)")
    if checksum and (not reuse or embeddings is not None):
        raise UserError("--checksum compares photos for reuse: it goes with an image source and without --reencode")
    if dry_run and embeddings is not None:
        raise UserError("--dry-run goes with an image source (precomputed vectors are indexed as they are)")
    if (image_root or drop_outside_paths) and embeddings is None:
        raise UserError("--image-root and --drop-outside-paths go with --embeddings (an image build serves the folder it indexes)")
    spec = index_spec(index_type, params)
    queries = None
    if query_vectors is not None:
        try:
            queries = np.load(query_vectors, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise UserError(f"--query-vectors {query_vectors}: not a readable .npy file ({exc})") from exc
    store = open_cli_store(backend, out, uri, collection)
    if source is None:
        assert embeddings is not None  # exactly one of the two, checked above
        if image_space is None:
            manifest = read_manifest(bundle or Settings().bundle_dir, verify=False)
            image_space, name, version = manifest.image_space, manifest.name, manifest.version
        else:
            name, version = "precomputed", ""
        bank = serving_hub_bank(hub_table, image_space)  # before the build: a refused --hub-table costs nothing
        result = build_snapshot_from_vectors(embeddings, store, image_space=image_space, bundle_name=name,
                                             bundle_version=version, metadata=metadata, spec=spec, normalize=normalize,
                                             target_recall=target_recall, queries=queries, image_roots=image_root,
                                             drop_outside_paths=drop_outside_paths, activate=bank is None)
        unit = "vectors"
    else:
        encoder = load_encoder(bundle)
        if dry_run:
            print_plan(plan_build(source, encoder, store, spec=spec, image_root=images, target_recall=target_recall,
                                  reuse=reuse, checksum=checksum))
            return
        bank = serving_hub_bank(hub_table, encoder.image_space)
        result = build_snapshot(
            source, encoder, store, spec=spec, image_root=images, batch_size=batch_size, workers=workers,
            target_recall=target_recall, activate=bank is None, reuse=reuse, checksum=checksum,
        )
        unit = "images"
    m = result.manifest
    publish_with_hub_table(store, m.version, bank)
    if result.report.get("unchanged"):
        console.print(f"nothing changed since {m.version} was built (the same files, captions, bundle and index "
                      f"settings): it stays current, {m.count} {unit}; --reencode builds a new version all the same",
                      soft_wrap=True, highlight=False)
        console.print(f"in {store.describe()}", soft_wrap=True, highlight=False)
    else:
        print_published(result, store, unit)
    for item in result.skipped:
        err.print(f"skipped {item['path']}: {item['error']}", highlight=False)


def print_published(result: BuildResult, store: SnapshotStore, unit: str) -> None:
    """What a build that published a new version says: its size, speed, recall and reuse."""
    m = result.manifest
    console.print(
        f"published {m.version}: {m.count} {unit}, index {m.index.type}, "
        f"{result.images_per_second:.1f} {unit}/s" + (f", recall@10 {m.recall_at_10:.3f}" if m.recall_at_10 is not None else ""),
        soft_wrap=True,
    )
    console.print(f"in {store.describe()}", soft_wrap=True, highlight=False)
    if result.report.get("reused"):
        r = result.report
        moved = f", {r['moved']} of them found by their bytes: moved, renamed or touched" if r.get("moved") else ""
        console.print(f"{r['reused']} vectors reused from {r['reused_from']} (files unchanged{moved}), "
                      f"{r['encoded']} images encoded", soft_wrap=True, highlight=False)
    if "peak_private_mb" in result.report:
        r = result.report
        console.print(f"peak memory {r['peak_rss_mb'] / 1024:.2f} GB resident, {r['peak_private_mb'] / 1024:.2f} GB of it "
                      f"private (the rest: vectors.npy pages written through its memory map); "
                      f"disk {r['disk_bytes'] / 2**30:.2f} GB", soft_wrap=True, highlight=False)
    if m.tuning is not None:
        t = m.tuning
        console.print(f"tuned for recall@10 >= {t['target_recall']} on {t['tuning_queries']} queries ({t['queries']}): "
                      f"{t['setting']} -> {t['recall_at_10_on_tuning_queries']:.3f} there, {m.recall_at_10:.3f} on "
                      f"{m.recall_queries} held-out queries" + ("" if t["reached"] else " (target NOT reached: the most "
                                                                 "accurate setting tried is kept)"))


@app.command("export")
@user_errors
def export_cmd(
    snapshot: Path = typer.Argument(..., help="Snapshot root or version folder."),
    out: Path = typer.Option(..., help="Folder to write img_emb/ and metadata/ into."),
    shard_size: int = typer.Option(1_000_000, min=1, help="Vectors per shard."),
    metadata_format: str = typer.Option("parquet", "--format", help="parquet | jsonl"),
):
    """Write a snapshot's vectors and metadata out in clip-retrieval's layout (img_emb/ + metadata/)."""
    written = export_snapshot_vectors(snapshot, out, shard_size=shard_size, metadata_format=metadata_format)
    console.print(f"{len(written)} shard(s) written to {out}; build them back with "
                  f"paraseek index build --embeddings {out} --image-space \"$(cat {out}/image_space.txt)\"")


@app.command("update")
@user_errors
def update_cmd(
    root: Optional[Path] = typer.Argument(None, help="Snapshot root (faiss; default: PARASEEK_SNAPSHOT)."),
    bundle: Optional[Path] = typer.Option(None),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    add: Optional[Path] = typer.Option(None, help="Image folder or COCO JSON to add."),
    remove: List[int] = typer.Option([], help="Image id to remove (repeatable)."),
    retrain: bool = typer.Option(False, help="Re-train IVF quantisers on the new contents."),
    hub_table: Optional[bool] = typer.Option(None, "--hub-table/--no-hub-table", help=HUB_TABLE_HELP),
):
    """Add/remove images: a new snapshot version, the old one untouched."""
    if add is None and not remove and not retrain:
        raise UserError("nothing to do: give --add, --remove or --retrain")
    store = open_cli_store(backend, root, uri, collection)
    encoder = load_encoder(bundle)
    bank = serving_hub_bank(hub_table, encoder.image_space)
    result = update_snapshot(store, encoder, add=add, remove=remove, retrain=retrain, activate=bank is None)
    publish_with_hub_table(store, result.manifest.version, bank)
    console.print(f"published {result.manifest.version} (parent {result.manifest.parent}): {result.manifest.count} images",
                  soft_wrap=True, highlight=False)


@app.command("copy")
@user_errors
def copy_cmd(
    snapshot: Optional[Path] = typer.Argument(None, help="FAISS snapshot root to copy (default: PARASEEK_SNAPSHOT)."),
    backend: str = typer.Option("milvus", help="Backend to copy into: " + BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    out: Optional[Path] = typer.Option(None, help="With --backend faiss: the snapshot root to copy into."),
    index_type: Optional[str] = typer.Option(None, "--type", help="Index type in the target (default: the source's)."),
    params: Optional[str] = typer.Option(None, help="Index parameters as JSON."),
    bundle: Optional[Path] = typer.Option(None, help="The snapshot's bundle: recall is then measured on caption queries."),
    target_recall: Optional[float] = typer.Option(None, min=0.0, max=1.0, help="Tune the target's nprobe/ef to this recall@10."),
    hub_table: Optional[bool] = typer.Option(None, "--hub-table/--no-hub-table", help=HUB_TABLE_HELP),
):
    """Copy a snapshot's current version into another backend (e.g. FAISS -> Milvus) without re-encoding."""
    source = Snapshot.load(snapshot or Settings().snapshot_root, use_gpu=False)  # read, not searched
    store = open_cli_store(backend, out, uri, collection)
    spec = index_spec(index_type, params) if index_type else None
    encoder = load_encoder(bundle) if bundle else None
    bank = serving_hub_bank(hub_table, source.manifest.image_space)
    result = copy_snapshot(source, store, spec=spec, encoder=encoder, target_recall=target_recall,
                           activate=bank is None)
    m = result.manifest
    publish_with_hub_table(store, m.version, bank)
    console.print(f"published {m.version}: {m.count} vectors from {source.version}, index {m.index.type}"
                  + (f", recall@10 {m.recall_at_10:.3f}" if m.recall_at_10 is not None else ""), soft_wrap=True)
    console.print(f"in {store.describe()}", soft_wrap=True, highlight=False)


@app.command("info")
@user_errors
def info_cmd(
    root: Optional[Path] = typer.Argument(None, help="Snapshot root or version directory (faiss)."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    version: Optional[str] = typer.Option(None, help="A version other than the current one."),
):
    """Print a snapshot version's manifest (default: the current version)."""
    if root is not None and (root / "manifest.json").is_file():  # a FAISS version folder
        console.print_json(read_snapshot_manifest(resolve(root)).model_dump_json())
        return
    store = open_cli_store(backend, root, uri, collection)
    console.print_json(store.manifest(version).model_dump_json())


@app.command("verify")
@user_errors
def verify_cmd(
    root: Optional[Path] = typer.Argument(None, help="Snapshot root or version directory (faiss; default: PARASEEK_SNAPSHOT)."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    version: Optional[str] = typer.Option(None, help="A version other than the current one."),
):
    """Check a snapshot version against its manifest: every file hashed again (a load re-hashes only the
    files changed since they were last verified), or, on Milvus, the server's vector count."""
    started = time.perf_counter()
    if root is not None and (root / "manifest.json").is_file():  # a FAISS version folder
        Snapshot.load(root, rehash=True, use_gpu=False)
        name = root.name
    else:
        store = open_cli_store(backend, root, uri, collection)
        name = store.manifest(version).version
        store.load(version, rehash=True, use_gpu=False)
    console.print(f"version {name}: matches its manifest ({time.perf_counter() - started:.1f} s)", highlight=False)


@app.command("hub-table")
@user_errors
def hub_table_cmd(
    root: Optional[Path] = typer.Argument(None, help="Snapshot root (faiss; default: PARASEEK_SNAPSHOT)."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    version: Optional[str] = typer.Option(None, help="A version other than the current one."),
):
    """Write a published version's hub table under PARASEEK_HUB_TABLES (default: PARASEEK_HOME/hub-tables; each
    image's hubness against the serving bundle's caption bank), so servers read it instead of computing it."""
    store = open_cli_store(backend, root, uri, collection)
    manifest = store.manifest(version)
    bank = serving_hub_bank(True, manifest.image_space)
    assert bank is not None  # wanted: refused above otherwise
    write_hub_table(store, manifest.version, bank)


@app.command("versions")
@user_errors
def versions_cmd(
    root: Optional[Path] = typer.Argument(None, help="Snapshot root (faiss; default: PARASEEK_SNAPSHOT)."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: the manifest and whether it is current."),
):
    """List the published versions, oldest first, the current one marked: what `index activate` can roll back to."""
    store = open_cli_store(backend, root, uri, collection)
    current = store.current_version()
    manifests = store.published_manifests()
    if not manifests:
        raise UserError(f"{store.describe()}: no published version")
    if as_json:
        for m in manifests:
            console.print_json(json.dumps({**m.model_dump(mode="json"), "current": m.version == current}), indent=None)
        return
    print_version_lines([("*" if m.version == current else " ", m.version, m.created_at, m.count, m.index.type,
                          m.recall_at_10, m.parent) for m in manifests])
    console.print(f"in {store.describe()}; * current", soft_wrap=True, highlight=False)


@app.command("activate")
@user_errors
def activate_cmd(
    root: Optional[Path] = typer.Argument(None, help="Snapshot root (faiss; default: PARASEEK_SNAPSHOT)."),
    version: Optional[str] = typer.Option(None, help="The version to serve (`paraseek index versions` lists them)."),
    previous: bool = typer.Option(False, "--previous", help="Roll back: the current version's parent, else the one "
                                  "published before it."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
    bundle: Optional[Path] = typer.Option(None, help="The bundle servers embed queries with (default: PARASEEK_BUNDLE): "
                                          "a version of another image space is refused."),
    hub_table: bool = typer.Option(False, "--hub-table", help="Write the version's hub table first where it is "
                                   "missing (about 7 MFLOP an image). By default a rollback never waits for one: "
                                   "servers read it back where it was written, else build it after they switch."),
):
    """Make a published version current (a rollback, or forward again). Servers with PARASEEK_SNAPSHOT_POLL_S
    follow within the interval; `POST /v1/admin/activate` does the same from a server."""
    if (version is None) == (not previous):
        raise UserError("give --version V or --previous (one of the two)")
    store = open_cli_store(backend, root, uri, collection)
    if version is not None and version not in (published := store.versions()):
        raise UserError(f"--version: no published version {version!r} in {store.describe()} (published: "
                        f"{', '.join(published[-5:]) or 'none'}; `paraseek index versions` lists them)")
    target = store.manifest(store.previous_version() if previous else version)
    try:  # servers embed queries with PARASEEK_BUNDLE: a version of another image space is one they refuse to load
        serving = read_manifest(bundle or Settings().bundle_dir, verify=False)
    except UserError:
        serving = None  # no bundle here to check against (a job without the model): servers check at load
    if serving is not None:
        check_image_space(target, serving.image_space)
    was = store.current_version()
    if target.version == was:
        console.print(f"{target.version} is already current", highlight=False)
        return
    bank = serving_hub_bank(True, target.image_space) if hub_table else None
    if bank is None:
        store.activate(target.version)
    else:  # its table read back, or written where it is missing, before servers load the version
        publish_with_hub_table(store, target.version, bank)
    console.print(f"current: {target.version} ({target.count} images, index {target.index.type}); was {was}",
                  highlight=False, soft_wrap=True)


@app.command("prune")
@user_errors
def prune_cmd(
    root: Optional[Path] = typer.Argument(None, help="Snapshot root (faiss; default: PARASEEK_SNAPSHOT)."),
    keep: Optional[int] = typer.Option(None, min=2, help="Published versions to keep, the newest (default: "
                                       "PARASEEK_SNAPSHOT_KEEP_VERSIONS, 5)."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
):
    """Delete the oldest published versions past --keep; never the current one or the one a rollback returns to."""
    store = open_cli_store(backend, root, uri, collection)
    removed = store.prune(keep if keep is not None else Settings().snapshot_keep_versions)
    console.print(f"removed {len(removed)} version(s)" + (f": {', '.join(removed)}" if removed else "")
                  + f"; {len(store.versions())} kept in {store.describe()}", highlight=False, soft_wrap=True)


@app.command("search")
@user_errors
def search_cmd(
    queries: List[str] = typer.Argument(..., help="One or more text queries."),
    root: Optional[Path] = typer.Option(None, "--snapshot", help="Snapshot root (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    k: int = typer.Option(5, "--k", "-k", min=1, max=1000, help="Results per query."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    filter_json: Optional[str] = typer.Option(None, "--filter", help='A metadata filter as JSON, e.g. \'{"licence": [1, 2]}\' '
                                              "or '{\"caption_contains\": \"dog\", \"id_range\": {\"lt\": 500000}}'."),
    backend: Optional[str] = typer.Option(None, help=BACKEND_HELP),
    uri: Optional[str] = typer.Option(None, help=URI_HELP),
    collection: Optional[str] = typer.Option(None, help=COLLECTION_HELP),
):
    """Search a snapshot with text queries from the command line."""
    flt = None
    if filter_json is not None:
        try:
            flt = SearchFilter.model_validate_json(filter_json)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise UserError(f"--filter{' ' + where if where else ''}: {first['msg']}") from exc
    enc = load_encoder(bundle, threads=1)
    snap = open_cli_store(backend, root, uri, collection).load(image_space=enc.image_space, threads=1)
    results = snap.search(enc.encode_text(queries), k, flt)
    if as_json:
        console.print_json(json.dumps([
            {"query": q, "results": [{"id": h.id, "score": h.score, "rank": h.rank, "path": h.metadata.get("path")} for h in hits]}
            for q, hits in zip(queries, results)
        ]))
        return
    for q, hits in zip(queries, results):
        print_results(q, hits)
