"""Paraphrases from any OpenAI-compatible chat endpoint, with ParaCLIP's two prompts, timeouts,
retries and an on-disk JSONL cache (so dataset generation can resume where it stopped)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from cachetools import LRUCache
from filelock import FileLock

from paraseek.paraphrase import ParaphraseSourceUnavailable

log = logging.getLogger(__name__)

# ParaCLIP's two-step generation: a paraphrase of the caption, then a paraphrase of that paraphrase
# "avoiding existing words", so x'' is lexically far from both.
PROMPT_PARAPHRASE = (
    "Paraphrase the following image caption. Keep its meaning, change its wording. "
    "Answer with the paraphrase only.\nCaption: {text}"
)
PROMPT_AVOID_WORDS = (
    "Paraphrase the following sentence, avoiding the existing words as much as possible "
    "(use different words and sentence structure, keep the meaning). Answer with the paraphrase only.\n"
    "Sentence: {text}"
)


# draws past n a one-step source makes for duplicates; a two-step pair is two calls and gives up to two texts
EXTRA_DRAWS = 2


def endpoint_calls(method: str, n: int) -> int:
    """The most endpoint calls ``n`` paraphrases by ``method`` can take (0 for sources without an
    endpoint): what a request's budget is checked against before any call."""
    if method == "generator":
        return 2 * n
    if method in LLMSource.PROMPTS:
        return n + EXTRA_DRAWS
    return 0


class LLMError(RuntimeError):
    """The endpoint failed after all retries, or gave nothing before the deadline."""


class LLMDeadline(LLMError):
    """The deadline for one text's calls passed before this call could be made or finished."""


class JsonlCache:
    """Append-only JSONL of {key, value}: survives crashes line by line, read once at start. At most
    ``max_entries`` answers are kept, the least recently used going first: in memory at once, and on
    disk when the file has grown to twice that (it is rewritten with what is kept)."""

    def __init__(self, path: str | os.PathLike | None, max_entries: int = 100_000):
        self.path = Path(path) if path else None
        self.max_entries = max_entries
        self._data: LRUCache[str, str] = LRUCache(max_entries)
        self._lines = 0
        self._lock = threading.Lock()
        if self.path and self.path.is_file():
            with open(self.path) as f:
                for line in f:
                    self._lines += 1
                    try:
                        row = json.loads(line)
                        self._data[row["key"]] = row["value"]
                    except (json.JSONDecodeError, KeyError):
                        continue  # a torn last line after a crash

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> str | None:
        with self._lock:  # an LRU read reorders it
            return self._data.get(key)

    def put(self, key: str, value: str) -> None:
        with self._lock:
            self._data[key] = value
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # processes sharing the file (dataset generation beside a server) append and compact in turn
                with FileLock(str(self.path) + ".lock"):
                    if self._lines >= 2 * self.max_entries:
                        self._compact()
                    with open(self.path, "a") as f:
                        f.write(json.dumps({"key": key, "value": value}) + "\n")
                    self._lines += 1

    def _compact(self) -> None:
        """Rewrite the file with its newest ``max_entries`` answers, read from the file itself (holding
        its lock): the lines other writers appended are kept by their age, not dropped for this one's."""
        assert self.path is not None
        kept: LRUCache[str, str] = LRUCache(self.max_entries)
        lines = 0
        with open(self.path) as f:
            for line in f:
                lines += 1
                try:
                    row = json.loads(line)
                    kept[row["key"]] = row["value"]
                except (json.JSONDecodeError, KeyError):
                    continue
        if lines < 2 * self.max_entries:  # another writer compacted it meanwhile
            self._lines = lines
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            for key, value in kept.items():
                f.write(json.dumps({"key": key, "value": value}) + "\n")
        os.replace(tmp, self.path)
        self._lines = len(kept)


class ChatClient:
    def __init__(self, base_url: str | None, model: str | None, api_key: str | None = None,
                 timeout: float = 20.0, retries: int = 2, cache_path: str | os.PathLike | None = None,
                 temperature: float = 0.8, deadline_s: float | None = None, cache_entries: int = 100_000):
        """``deadline_s``: all the calls for one text's paraphrases (``deadline()``) end by then."""
        if not base_url or not model:
            raise ParaphraseSourceUnavailable("no LLM endpoint configured (PARASEEK_LLM_BASE_URL and PARASEEK_LLM_MODEL)")
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.retries = retries
        self.temperature = temperature
        self.deadline_s = deadline_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self.cache = JsonlCache(cache_path, cache_entries)

    def deadline(self) -> float | None:
        """The monotonic time by which the calls for one text must end (None: no deadline)."""
        return None if self.deadline_s is None else time.monotonic() + self.deadline_s

    def complete(self, prompt: str, sample: int = 0, deadline: float | None = None) -> str:
        """One chat completion; ``sample`` distinguishes repeated draws of the same prompt in the cache.
        No attempt starts, and none lasts, past ``deadline`` (``LLMDeadline``)."""
        key = hashlib.sha256(json.dumps([self.model, prompt, sample, self.temperature]).encode()).hexdigest()
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature, "n": 1}
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise LLMDeadline(f"LLM endpoint: no answer within the deadline ({_reason(last) if last else 'no attempt left'})")
            try:
                timeout = self.timeout if remaining is None else min(self.timeout, remaining)
                resp = self._http.post(f"{self.base_url}/chat/completions", json=body, timeout=timeout)
                if resp.status_code >= 500 or resp.status_code == 429:
                    raise LLMError(f"HTTP {resp.status_code}")
                resp.raise_for_status()
                text = resp.json()["choices"][0]["message"]["content"].strip().strip('"').strip()
                if not text:
                    raise LLMError("empty completion")
                self.cache.put(key, text)
                return text
            except Exception as exc:  # network errors, bad JSON, HTTP errors: retry with backoff
                last = exc
                if attempt < self.retries:
                    pause = 0.2 * 2**attempt
                    time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
        log.warning("LLM endpoint %s failed after %d attempts: %s", _redacted(self.base_url), self.retries + 1, last)
        raise LLMError(f"LLM endpoint failed after {self.retries + 1} attempts: {_reason(last)}")


def _reason(exc: Exception | None) -> str:
    """What a client may read of an endpoint failure: the status or the kind of error, never the
    endpoint's address (httpx's messages name the URL, with any credentials or key in it)."""
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, httpx.HTTPError):
        return type(exc).__name__  # ConnectError, ReadTimeout ...
    if isinstance(exc, LLMError):
        return str(exc)  # this module's own messages
    return type(exc).__name__ if exc is not None else "no answer"


def _redacted(url: str) -> str:
    """``url`` for the log: scheme, host, port and path, without user info or query."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


def _until_deadline(draw, n: int, client: ChatClient) -> list[str]:
    """Paraphrases from ``draw(deadline)`` (it appends to the list it returns) until n or the deadline:
    what came back in time is kept; nothing at all is an ``LLMError``."""
    out: list[str] = []
    try:
        draw(out, client.deadline())
    except LLMDeadline as exc:
        if not out:
            raise LLMError(f"no paraphrase within {client.deadline_s:g} s: {exc}") from exc
    return out[:n]


class LLMSource:
    """One-step paraphrases: n draws of one prompt. ``name="llm"``: ParaCLIP's first prompt (x');
    ``name="llm-avoid-words"``: its second prompt alone (x'' from x', avoiding the words of x')."""

    PROMPTS = {"llm": PROMPT_PARAPHRASE, "llm-avoid-words": PROMPT_AVOID_WORDS}

    def __init__(self, client: ChatClient, name: str = "llm"):
        self.client = client
        self.name = name
        self.prompt = self.PROMPTS[name]

    def paraphrases(self, text: str, n: int) -> list[str]:
        def draw(out: list[str], deadline: float | None) -> None:
            for i in range(n + EXTRA_DRAWS):  # a few extra draws in case of duplicates
                p = self.client.complete(self.prompt.format(text=text), sample=i, deadline=deadline)
                if p.lower() != text.lower() and p not in out:
                    out.append(p)
                if len(out) == n:
                    return

        return _until_deadline(draw, n, self.client)


class TwoStepGenerator:
    """ParaCLIP's generation: x' = paraphrase(x), x'' = paraphrase(x', avoiding existing words).
    ``paraphrases`` returns x', x'', x'(2), x''(2), ... up to n texts."""

    name = "generator"

    def __init__(self, client: ChatClient):
        self.client = client

    def pair(self, text: str, sample: int = 0, deadline: float | None = None) -> tuple[str, str]:
        x1 = self.client.complete(PROMPT_PARAPHRASE.format(text=text), sample=sample, deadline=deadline)
        x2 = self.client.complete(PROMPT_AVOID_WORDS.format(text=x1), sample=sample, deadline=deadline)
        return x1, x2

    def paraphrases(self, text: str, n: int) -> list[str]:
        def draw(out: list[str], deadline: float | None) -> None:
            sample = 0
            while len(out) < n and sample < n:
                for p in self.pair(text, sample, deadline):
                    if p.lower() != text.lower() and p not in out and len(out) < n:
                        out.append(p)
                sample += 1

        return _until_deadline(draw, n, self.client)
