"""The one place that turns a method name and the settings into a paraphrase source: the service
(expansion, consistency), the CLI (evaluation) and training (x', x'') all call ``make_source``."""

from __future__ import annotations

from pathlib import Path

from paraseek.core.settings import Settings
from paraseek.paraphrase import ParaphraseSource, ParaphraseSourceUnavailable

# llm: ParaCLIP's first prompt (x'); llm-avoid-words: its second prompt alone (x'' from x');
# generator: both steps
METHODS = ("wordnet", "ppdb", "llm", "llm-avoid-words", "generator")


def make_source(method: str, settings: Settings, *, ppdb_path: str | Path | None = None,
                usual_only: bool = True) -> ParaphraseSource:
    """A ready source; raises ``ParaphraseSourceUnavailable`` when it is not configured or its data
    is missing. ``ppdb_path`` overrides ``settings.ppdb_path`` (a recipe's own PPDB file).
    ``usual_only``: WordNet and PPDB rewrite only toward more usual wording, which makes query expansion
    raise consistency; training's x'' wants every reliable synonym instead (ParaCLIP: avoid the words used)."""
    if method == "wordnet":
        from paraseek.paraphrase.wordnet import WordNetSource

        return WordNetSource() if usual_only else WordNetSource(senses=3, min_ratio=-1.0)
    if method == "ppdb":
        from paraseek.paraphrase.ppdb import PPDBSource

        return PPDBSource(ppdb_path or settings.ppdb_path, usual_only=usual_only)
    if method in ("llm", "llm-avoid-words", "generator"):
        from paraseek.paraphrase.llm import ChatClient, LLMSource, TwoStepGenerator

        client = ChatClient(
            settings.llm_base_url, settings.llm_model,
            settings.llm_api_key.get_secret_value() if settings.llm_api_key else None,
            timeout=settings.llm_timeout_s, retries=settings.llm_retries, cache_path=settings.llm_cache_path,
            deadline_s=settings.llm_deadline_s, cache_entries=settings.llm_cache_entries,
        )
        return TwoStepGenerator(client) if method == "generator" else LLMSource(client, name=method)
    raise ParaphraseSourceUnavailable(f"unknown paraphrase method {method!r} (one of {', '.join(METHODS)})")
