"""GrammarSpec -> xgrammar CompiledGrammar, cached by content hash.

xgrammar was measured against llguidance on SmolLM2's 49k vocabulary (benchmarks/grammar_backends.py):
per-step mask time for 16 rows 4.0 ms median / 4.2 ms p90 vs 4.6-5.3 / 8.5-8.8 ms, cached compile
~0.05 ms vs 1.2-1.8 ms per matcher; it is also vLLM's default backend. Compiling a schema takes 5-25 ms
here the first time, so the API compiles in a worker thread before the request reaches the engine,
and the engine thread only ever finds the grammar in the cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.request import GrammarSpec
from server.structured.schema_check import SchemaNotEnforceable, check_schema

# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; the rest is the useful part.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that does not compile. The message names the problem."""


@dataclass
class CompileStats:
    """Cumulative compile counters (for /metrics and benchmarks). Seconds are wall time."""

    compiled: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0


compile_stats = CompileStats()


def spec_key(spec: GrammarSpec) -> str:
    """sha256 of the spec's content: equal specs share one compiled grammar."""
    return hashlib.sha256(json.dumps([spec.kind, spec.value]).encode()).hexdigest()


def choice_to_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings (JSON escapes are valid in EBNF)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer; thread-safe (API threads compile, the engine reads).

    vocab_size is the model's logits width (may exceed the tokenizer's); eos_token_ids are the tokens
    allowed once the grammar is complete.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self._xgr_compiler: Any = None  # built on first use: engines that never constrain pay nothing
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def _xgr(self) -> Any:
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                try:
                    info = xgr.TokenizerInfo.from_huggingface(
                        self._hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos
                    )
                except Exception as e:  # a tokenizer xgrammar cannot read: no grammars, the rest serves
                    raise GrammarError(
                        f"structured outputs are unavailable for this tokenizer: {e}"
                    ) from None
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """Returns an xgrammar CompiledGrammar. Raises GrammarError naming what does not compile."""
        key = spec_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                compile_stats.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        compiled = self._compile(spec)
        with self._lock:
            compile_stats.compiled += 1
            compile_stats.compile_seconds += time.perf_counter() - t0
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        what = {
            "json": "JSON schema",
            "json_object": "JSON",
            "regex": "regex",
            "choice": "choice",
            "grammar": "grammar",
        }[spec.kind]
        xc = self._xgr
        try:
            if spec.kind == "json":
                schema = json.loads(spec.value)
                if not isinstance(schema, dict | bool):
                    raise GrammarError("a JSON schema must be an object or a boolean")
                try:
                    check_schema(schema)
                except SchemaNotEnforceable as e:  # refused by name rather than silently not enforced
                    raise GrammarError(str(e)) from None
                return xc.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return xc.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                if not spec.value:
                    raise GrammarError("the regex is empty")
                return xc.compile_regex(spec.value)
            if spec.kind == "choice":
                choices = json.loads(spec.value)
                if not isinstance(choices, list):
                    raise GrammarError("choice must be a list of strings")
                return xc.compile_grammar(choice_to_ebnf(choices))
            return xc.compile_grammar(spec.value)
        except GrammarError as e:
            raise GrammarError(f"invalid {what}: {e}") from None
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid {what}: not valid JSON: {e}") from None
        except (RuntimeError, ValueError, TypeError) as e:
            msg = _CPP_PREFIX.sub("", str(e).strip()).strip()
            raise GrammarError(f"invalid {what}: {msg}") from None
