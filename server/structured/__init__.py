"""Structured outputs: grammar-constrained decoding with xgrammar (compiler cache + per-request matchers)."""

from server.structured.compiler import GrammarCompiler, GrammarError, compile_stats
from server.structured.manager import StructuredOutputManager

__all__ = ["GrammarCompiler", "GrammarError", "StructuredOutputManager", "compile_stats"]
