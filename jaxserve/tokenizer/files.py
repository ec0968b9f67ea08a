"""What a model directory says about its tokenizer: which vocabulary file, the configs, the chat templates.

Nothing here parses a vocabulary; `backend.py` turns the chosen file into a `tokenizers.Tokenizer`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
CHAT_TEMPLATE_JSON = "chat_template.json"
MODEL_CONFIG = "config.json"

LOOKED_FOR = (f"{TOKENIZER_JSON} or {SENTENCEPIECE_MODEL} (plus, when present, {TOKENIZER_CONFIG}, "
              f"{SPECIAL_TOKENS_MAP}, {GENERATION_CONFIG}, {CHAT_TEMPLATE_JINJA}, {CHAT_TEMPLATE_DIR}/*.jinja, {CHAT_TEMPLATE_JSON}, "
              f"{MODEL_CONFIG})")


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer files of one model directory, read but not interpreted.

    The vocabulary is tokenizer.json when the directory has one (`tokenizer_json`, its text: it carries the
    normalizer, pre-tokenizer and post-processor as transformers uses them), else the sentencepiece model at
    `sentencepiece_model`; exactly one of the two is set. The other JSON files are {} when absent.
    `chat_templates` maps template names to Jinja sources; a lone template is named "default".
    `model_type` is config.json's, which decides the tokenizer class transformers picks (see backend.py).
    The dicts are never mutated after loading.
    """

    model_dir: Path
    tokenizer_json: str | None = dataclasses.field(repr=False)
    sentencepiece_model: Path | None
    config: dict[str, Any]
    special_tokens_map: dict[str, Any]
    generation_config: dict[str, Any]
    chat_templates: dict[str, str]
    model_type: str | None

    @property
    def is_sentencepiece(self) -> bool:
        return self.tokenizer_json is None


def read_tokenizer_files(model_dir: str | Path, model_type: str | None = None,
                         chat_template: str | None = None) -> TokenizerFiles:
    """Reads a model directory. `model_type` overrides config.json's (a converted checkpoint may not carry
    config.json); `chat_template` (a .jinja path or the template text) replaces the directory's templates."""
    model_dir = Path(model_dir)
    config = read_json(model_dir / TOKENIZER_CONFIG)
    vocabulary = vocabulary_file(model_dir)
    is_json = vocabulary.name == TOKENIZER_JSON
    return TokenizerFiles(
        model_dir=model_dir,
        tokenizer_json=vocabulary.read_text(encoding="utf-8") if is_json else None,
        sentencepiece_model=None if is_json else vocabulary,
        config=config,
        special_tokens_map=read_json(model_dir / SPECIAL_TOKENS_MAP),
        generation_config=read_json(model_dir / GENERATION_CONFIG),
        chat_templates=({"default": template_source(chat_template)} if chat_template is not None
                        else chat_templates_in(model_dir, config)),
        model_type=model_type or read_json(model_dir / MODEL_CONFIG).get("model_type"),
    )


def vocabulary_file(model_dir: Path) -> Path:
    for name in (TOKENIZER_JSON, SENTENCEPIECE_MODEL):
        if (model_dir / name).is_file():
            return model_dir / name
    raise FileNotFoundError(f"no tokenizer in {model_dir}: looked for {LOOKED_FOR}")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def chat_templates_in(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """Template files win over the config's entry, as in transformers; chat_template.json (the processor file,
    which transformers' tokenizer ignores) is the last resort rather than having no template."""
    files = {}
    if (model_dir / CHAT_TEMPLATE_JINJA).is_file():
        files["default"] = (model_dir / CHAT_TEMPLATE_JINJA).read_text(encoding="utf-8")
    for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files
    if config.get("chat_template"):
        return named_templates(config["chat_template"])
    return named_templates(read_json(model_dir / CHAT_TEMPLATE_JSON).get("chat_template"))


def named_templates(entry: str | list | dict | None) -> dict[str, str]:
    """A config's chat_template: one source, a list of {"name", "template"}, or nothing."""
    if not entry:
        return {}
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, dict):
        return dict(entry)
    return {item["name"]: item["template"] for item in entry}


def template_source(chat_template: str) -> str:
    """A path to a template file, or the template itself (anything with Jinja syntax or a newline in it)."""
    path = Path(chat_template)
    if any(c in chat_template for c in "{}\n"):
        return chat_template
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise FileNotFoundError(f"chat template {chat_template!r} is neither a file nor a Jinja template")
