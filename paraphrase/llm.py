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

from paraphrase import ParaphraseSourceUnavailable

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


class LLMError(RuntimeError):
    """The endpoint failed after all retries."""


class JsonlCache:
    """Append-only JSONL of {key, value}: survives crashes line by line, read once at start."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self._data: dict[str, str] = {}
        self._lock = threading.Lock()
        if self.path and self.path.is_file():
            with open(self.path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                        self._data[row["key"]] = row["value"]
                    except (json.JSONDecodeError, KeyError):
                        continue  # a torn last line after a crash

    def get(self, key: str) -> str | None:
        return self._data.get(key)

    def put(self, key: str, value: str) -> None:
        with self._lock:
            self._data[key] = value
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(json.dumps({"key": key, "value": value}) + "\n")


class ChatClient:
    def __init__(self, base_url: str | None, model: str | None, api_key: str | None = None,
                 timeout: float = 20.0, retries: int = 2, cache_path: str | os.PathLike | None = None,
                 temperature: float = 0.8):
        if not base_url or not model:
            raise ParaphraseSourceUnavailable("no LLM endpoint configured (PARASEEK_LLM_BASE_URL and PARASEEK_LLM_MODEL)")
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self.cache = JsonlCache(cache_path)

    def complete(self, prompt: str, sample: int = 0) -> str:
        """One chat completion; ``sample`` distinguishes repeated draws of the same prompt in the cache."""
        key = hashlib.sha256(json.dumps([self.model, prompt, sample, self.temperature]).encode()).hexdigest()
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature, "n": 1}
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.post(f"{self.base_url}/chat/completions", json=body)
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
                    time.sleep(0.2 * 2**attempt)
        raise LLMError(f"LLM endpoint {self.base_url} failed after {self.retries + 1} attempts: {last}")


class LLMSource:
    """One-step paraphrases: n draws of one prompt. ``name="llm"``: ParaCLIP's first prompt (x');
    ``name="llm-avoid-words"``: its second prompt alone (x'' from x', avoiding the words of x')."""

    PROMPTS = {"llm": PROMPT_PARAPHRASE, "llm-avoid-words": PROMPT_AVOID_WORDS}

    def __init__(self, client: ChatClient, name: str = "llm"):
        self.client = client
        self.name = name
        self.prompt = self.PROMPTS[name]

    def paraphrases(self, text: str, n: int) -> list[str]:
        out: list[str] = []
        for i in range(n * 2):  # a few extra draws in case of duplicates
            p = self.client.complete(self.prompt.format(text=text), sample=i)
            if p.lower() != text.lower() and p not in out:
                out.append(p)
            if len(out) == n:
                break
        return out


class TwoStepGenerator:
    """ParaCLIP's generation: x' = paraphrase(x), x'' = paraphrase(x', avoiding existing words).
    ``paraphrases`` returns x', x'', x'(2), x''(2), ... up to n texts."""

    name = "generator"

    def __init__(self, client: ChatClient):
        self.client = client

    def pair(self, text: str, sample: int = 0) -> tuple[str, str]:
        x1 = self.client.complete(PROMPT_PARAPHRASE.format(text=text), sample=sample)
        x2 = self.client.complete(PROMPT_AVOID_WORDS.format(text=x1), sample=sample)
        return x1, x2

    def paraphrases(self, text: str, n: int) -> list[str]:
        out: list[str] = []
        sample = 0
        while len(out) < n and sample < n:
            for p in self.pair(text, sample):
                if p.lower() != text.lower() and p not in out and len(out) < n:
                    out.append(p)
            sample += 1
        return out
