"""Text ⇄ token ids for the server and engine: tokenizer files, chat templates, incremental detokenization.

This layer imports nothing else of jaxserve and never jax (DESIGN.md, "Layers and who owns what").

    load_tokenizer(model_dir) -> Tokenizer        encode / decode / apply_chat_template / encode_chat
    IncrementalDetokenizer(tokenizer, prompt_ids)  add(new_ids) -> text delta, flush() at the end
    ChatTemplateError, NoChatTemplateError         client errors (HTTP 400) from apply_chat_template
"""

from jaxserve.tokenizer.chat_template import ChatTemplateError, NoChatTemplateError
from jaxserve.tokenizer.detokenizer import IncrementalDetokenizer
from jaxserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "NoChatTemplateError", "Tokenizer", "load_tokenizer"]
