"""Grammar compilation off the engine's thread, cached per constraint.

A constraint is compiled once into a *template* matcher (an ``llguidance.LLMatcher`` at the
start of its grammar, its first mask already computed so the lexer is built); each constrained
sequence gets a ``deep_copy`` of it, which is cheap. Compilation runs on a small thread pool
(llguidance releases the GIL while it builds a grammar), so the engine thread never waits for
it: a request whose grammar is not ready is simply not scheduled yet (``Engine`` holds it
back), and the other requests' steps go on.

The cache maps :func:`grammar.grammar_key` to the compilation's ``Future``: a second request
with the same schema shares the first one's work, even while it is still running. The oldest
entries are dropped past ``max_cached``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import TYPE_CHECKING, Callable

from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.structured_output.grammar import check_grammar, grammar_key

if TYPE_CHECKING:
    import llguidance


class GrammarCompileError(RuntimeError):
    """llguidance refused a grammar that passed ``check_grammar`` (a limit hit while building it)."""


class GrammarCompiler:
    def __init__(self, make_tokenizer: Callable[[], llguidance.LLTokenizer], num_threads: int = 2,
                 max_cached: int = 512):
        """``make_tokenizer`` builds the ``LLTokenizer`` (once, on the first compilation)."""
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compiler")
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.num_compiled = 0  # compilations started (cache misses)
        self.num_cache_hits = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def submit(self, constraint: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the template matcher of ``constraint``, compiling it unless cached."""
        key = grammar_key(constraint)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def _compile(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        import llguidance
        import llguidance.numpy as llguidance_numpy

        grammar = check_grammar(constraint)
        tokenizer = self.tokenizer
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(matcher.get_error())
        # The first mask builds the lexer; every copy of this template shares it.
        mask = llguidance_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        llguidance_numpy.fill_next_token_bitmask(matcher, mask)
        if matcher.is_error():
            raise GrammarCompileError(matcher.get_error())
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
