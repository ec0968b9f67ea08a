"""Structured output: constrain sampling to a JSON schema, a regex, a choice of strings or a grammar, and tool calls.

    params.py    StructuredOutputsParams: what a request asks for (no grammar engine imported)
    grammar.py   GrammarCompiler: constraint -> compiled llguidance grammar, cached per (constraint, tokenizer)
    matchers.py  StructuredOutputs: one matcher per constrained sequence, the per-step token bitmask
    tools.py     OpenAI tools: tool_choice -> a constraint; the model's tool-call syntax -> tool_calls
"""

from jaxserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
