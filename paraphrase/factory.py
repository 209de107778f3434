"""The one place that turns a method name and the settings into a paraphrase source: the service
(expansion, consistency), the CLI (evaluation) and training (x', x'') all call ``make_source``, and the
request schema reads the names from ``SOURCES``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from paraseek.core.settings import Settings
from paraseek.paraphrase import ParaphraseSource, ParaphraseSourceUnavailable

# (settings, ppdb_path, usual_only) -> a source
SourceFactory = Callable[[Settings, "str | Path | None", bool], ParaphraseSource]


def _wordnet(settings: Settings, ppdb_path: str | Path | None, usual_only: bool) -> ParaphraseSource:
    from paraseek.paraphrase.wordnet import WordNetSource

    return WordNetSource() if usual_only else WordNetSource(senses=3, min_ratio=-1.0)


def _ppdb(settings: Settings, ppdb_path: str | Path | None, usual_only: bool) -> ParaphraseSource:
    from paraseek.paraphrase.ppdb import PPDBSource

    return PPDBSource(ppdb_path or settings.ppdb_path, usual_only=usual_only)


def _llm(step: str) -> SourceFactory:
    def make(settings: Settings, ppdb_path: str | Path | None, usual_only: bool) -> ParaphraseSource:
        from paraseek.paraphrase.llm import ChatClient, LLMSource, TwoStepGenerator

        client = ChatClient(
            settings.llm_base_url, settings.llm_model,
            settings.llm_api_key.get_secret_value() if settings.llm_api_key else None,
            timeout=settings.llm_timeout_s, retries=settings.llm_retries, cache_path=settings.llm_cache_path,
            deadline_s=settings.llm_deadline_s, cache_entries=settings.llm_cache_entries,
        )
        return TwoStepGenerator(client) if step == "generator" else LLMSource(client, name=step)

    return make


# llm: ParaCLIP's first prompt (x'); llm-avoid-words: its second prompt alone (x'' from x');
# generator: both steps
SOURCES: dict[str, SourceFactory] = {
    "wordnet": _wordnet,
    "ppdb": _ppdb,
    "llm": _llm("llm"),
    "llm-avoid-words": _llm("llm-avoid-words"),
    "generator": _llm("generator"),
}
NEEDS_LLM = frozenset({"llm", "llm-avoid-words", "generator"})


def source_configured(method: str, settings: Settings) -> bool:
    """Whether ``make_source`` can be expected to work: the LLM methods need PARASEEK_LLM_BASE_URL and PARASEEK_LLM_MODEL."""
    return method in SOURCES and (method not in NEEDS_LLM or bool(settings.llm_base_url and settings.llm_model))


def make_source(method: str, settings: Settings, *, ppdb_path: str | Path | None = None,
                usual_only: bool = True) -> ParaphraseSource:
    """A ready source; raises ``ParaphraseSourceUnavailable`` when it is not configured or its data
    is missing. ``ppdb_path`` overrides ``settings.ppdb_path`` (a recipe's own PPDB file).
    ``usual_only``: WordNet and PPDB rewrite only toward more usual wording, which makes query expansion
    raise consistency; training's x'' wants every reliable synonym instead (ParaCLIP: avoid the words used)."""
    factory = SOURCES.get(method)
    if factory is None:
        raise ParaphraseSourceUnavailable(f"unknown paraphrase method {method!r} (one of {', '.join(SOURCES)})")
    return factory(settings, ppdb_path, usual_only)
