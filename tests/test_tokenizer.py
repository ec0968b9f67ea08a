"""The tokenizer layer against transformers' own outputs, and the incremental detokenizer's invariants.

Fixtures: tests/fixtures/tokenizers/ (tiny sentencepiece and byte-level BPE tokenizers, and reference.json with what
transformers 5 does with them), rebuilt by tests/fixtures/tokenizers/make_tokenizers.py.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import unicodedata
from datetime import datetime
from pathlib import Path

import pytest

from jaxserve.tokenizer import (ChatTemplateError, IncrementalDetokenizer, NoChatTemplateError, Tokenizer,
                                load_tokenizer)

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text(encoding="utf-8"))
DIRS = sorted(REFERENCE["tokenizers"])
TEXTS = [e["text"] for e in REFERENCE["tokenizers"][DIRS[0]]["encodes"]]
SPECIAL_STRINGS = ("<s>", "</s>", "<|", "[INST]", "[/INST]", "<think>", "</think>")
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return {d: load_tokenizer(FIXTURES / d) for d in DIRS}


def case_id(case: dict) -> str:
    return f"{case['dir']}-{case['name']}-{'gen' if case['add_generation_prompt'] else 'nogen'}"


# ------------------------------------------------------------------------------------------------ loading, ids

@pytest.mark.parametrize("name", DIRS)
def test_special_ids_match_transformers(tokenizers, name):
    tok, ref = tokenizers[name], REFERENCE["tokenizers"][name]
    assert tok.vocab_size == ref["vocab_size"]
    assert tok.bos_token_id == ref["bos_token_id"]
    assert tok.eos_token_ids[0] == ref["eos_token_id"]
    assert tok.pad_token_id == ref["pad_token_id"]
    assert tok.unk_token_id == ref["unk_token_id"]
    assert list(tok.all_special_ids) == ref["all_special_ids"]
    assert {k: v for k, v in tok.special_tokens.named.items()} == ref["special_tokens_map"]
    for token_id, token in ref["tokens"].items():
        assert tok.id_to_token(int(token_id)) == token


def test_eos_ids_are_the_tokenizers_then_generation_configs(tokenizers):
    llama3 = tokenizers["llama3_bbpe"]
    eot, end_of_text, eom = (llama3.encode(t, add_special_tokens=False)[0]
                             for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"))
    assert llama3.eos_token_ids == (eot, end_of_text, eom)
    qwen2 = tokenizers["qwen2_bbpe"]
    assert qwen2.eos_token_ids == (qwen2.encode("<|im_end|>")[0], qwen2.encode("<|endoftext|>")[0])
    assert tokenizers["llama2_json"].eos_token_ids == (2,)  # generation_config's eos is the same id, kept once
    assert tokenizers["qwen3_bbpe"].eos_token_ids == (qwen2.encode("<|im_end|>")[0],)  # no generation_config.json


@pytest.mark.parametrize("name", DIRS)
def test_encode_matches_transformers(tokenizers, name):
    tok = tokenizers[name]
    for entry in REFERENCE["tokenizers"][name]["encodes"]:
        assert tok.encode(entry["text"]) == entry["ids"], entry["text"]
        assert tok.encode(entry["text"], add_special_tokens=False) == entry["ids_no_special"], entry["text"]


@pytest.mark.parametrize("name", DIRS)
def test_decode_matches_transformers(tokenizers, name):
    tok = tokenizers[name]
    for entry in REFERENCE["tokenizers"][name]["encodes"]:
        for case in entry["decodes"]:
            assert tok.decode(case["ids"], skip_special_tokens=False) == case["decode"], case["ids"]
            assert tok.decode(case["ids"]) == case["decode_skip"], case["ids"]


@pytest.mark.parametrize("name", DIRS)
def test_plain_text_round_trips(tokenizers, name):
    """Text without leading whitespace or special-token strings comes back exactly (NFC-normalised for Qwen)."""
    tok = tokenizers[name]
    for text in TEXTS:
        if text[:1].isspace() or any(s in text for s in SPECIAL_STRINGS):
            continue
        expected = unicodedata.normalize("NFC", text) if name.startswith("qwen") else text
        assert tok.decode(tok.encode(text)) == expected


@pytest.mark.parametrize("name", ["llama2_spm", "llama2_json"])
def test_llama_pipeline_drops_one_leading_space_like_transformers(tokenizers, name):
    tok = tokenizers[name]
    assert tok.decode(tok.encode(" leading space")) == "leading space"
    assert tok.decode(tok.encode("  two")) == " two"


def test_missing_tokenizer_names_the_files_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json or tokenizer\.model.*tokenizer_config\.json"):
        load_tokenizer(tmp_path)


def test_sentencepiece_dir_adds_bos_unless_config_says_otherwise(tmp_path):
    """Without add_bos_token, LlamaTokenizer's default (True), not transformers 5's (no BOS without a
    tokenizer.json): Llama and Mistral models are trained with BOS."""
    shutil.copy(FIXTURES / "llama2_spm" / "tokenizer.model", tmp_path)
    assert load_tokenizer(tmp_path).encode("Hello")[0] == 1
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": True}))
    ids = load_tokenizer(tmp_path).encode("Hello")
    assert ids[0] != 1 and ids[-1] == 2


@pytest.mark.parametrize("name, model_type, text", [
    ("mistral_json", "mistral", "  two leading spaces"),  # tokenizer.json as written, not LlamaTokenizer's
    ("qwen2_relabelled", "qwen2", "12345 3.14159 99 bottles"),  # Qwen2Tokenizer's pipeline, not the file's
])
def test_model_type_argument_stands_in_for_config_json(tmp_path, name, model_type, text):
    """transformers picks the tokenizer class from config.json's model_type too; a checkpoint directory without
    config.json passes model_type instead."""
    for path in (FIXTURES / name).iterdir():
        if path.name != "config.json":
            shutil.copy(path, tmp_path)
    expected = next(e["ids"] for e in REFERENCE["tokenizers"][name]["encodes"] if e["text"] == text)
    assert load_tokenizer(tmp_path, model_type=model_type).encode(text) == expected
    assert load_tokenizer(tmp_path).encode(text) != expected


def test_byte_level_tokenizer_labelled_llama_is_used_as_written(tmp_path, tokenizers):
    """Some Llama 3 derivatives say LlamaTokenizerFast; transformers then keeps their byte-level tokenizer.json."""
    shutil.copy(FIXTURES / "llama3_bbpe" / "tokenizer.json", tmp_path)
    config = json.loads((FIXTURES / "llama3_bbpe" / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizerFast"}))
    relabelled = load_tokenizer(tmp_path)
    for entry in REFERENCE["tokenizers"]["llama3_bbpe"]["encodes"]:
        assert relabelled.encode(entry["text"]) == entry["ids"]


def test_tokenizer_layer_imports_no_jax_and_nothing_else_of_ours():
    # what `import jaxserve` itself loads (jaxserve/__init__.py: the host allocator settings) does not count
    code = ("import sys, jaxserve; package = set(sys.modules); import jaxserve.tokenizer; "
            "print(sorted(m for m in set(sys.modules) - package if m.split('.')[0] in ('jax', 'jaxlib', 'flax') "
            "or (m.startswith('jaxserve.') and not m.startswith('jaxserve.tokenizer'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------------- chat templates

@pytest.mark.parametrize("case", REFERENCE["chats"], ids=case_id)
def test_chat_template_matches_transformers(case):
    override = REFERENCE["templates"][case["template"]] if case["template"] else None
    tok = load_tokenizer(FIXTURES / case["dir"], chat_template=override)
    kwargs = dict(add_generation_prompt=case["add_generation_prompt"], tools=case["tools"], **case["extra"])
    if "error" in case:
        with pytest.raises(ChatTemplateError) as raised:
            tok.apply_chat_template(case["messages"], **kwargs)
        assert str(raised.value) == case["error"]  # the template's raise_exception message, unchanged
        return
    assert tok.apply_chat_template(case["messages"], **kwargs) == case["rendered"]
    assert tok.encode_chat(case["messages"], **kwargs) == case["ids"]


def test_no_chat_template_is_a_specific_error(tokenizers):
    tok = tokenizers["llama2_spm"]
    assert not tok.has_chat_template and tokenizers["qwen3_bbpe"].has_chat_template
    with pytest.raises(NoChatTemplateError) as raised:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(raised.value) == ("this model has no chat template; use /v1/completions or give the tokenizer a "
                                 "chat_template")
    assert isinstance(raised.value, ChatTemplateError)


def test_chat_template_from_file_replaces_the_models(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}{{ eos_token }}")
    tok = load_tokenizer(FIXTURES / "llama2_spm", chat_template=str(path))
    assert tok.apply_chat_template([{"role": "user", "content": "안녕"}]) == "user=안녕;</s>"


def test_template_files_and_names(tmp_path):
    """chat_template.jinja and additional_chat_templates/*.jinja win over tokenizer_config.json ("tool_use" is
    picked when tools are given); chat_template.json, the processor file, is the last resort."""
    shutil.copy(FIXTURES / "qwen2_bbpe" / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config", "eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "processor {{ eos_token }}"}))
    messages = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "config"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "processor <|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("file")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools {{ tools | length }}")
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template(messages) == "file"
    assert tok.apply_chat_template(messages, tools=[{"name": "f"}]) == "tools 1"


def test_strftime_now_gives_todays_date(tokenizers):
    today = datetime.now().strftime("%d %b %Y")
    rendered = tokenizers["llama3_bbpe"].apply_chat_template([{"role": "user", "content": "hi"}])
    assert f"Today Date: {today}\n" in rendered


def test_rendering_leaves_the_messages_untouched(tokenizers):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add", "tool_calls": None}]
    before = json.dumps(messages)
    tokenizers["qwen3_bbpe"].apply_chat_template(messages, add_generation_prompt=False)
    assert json.dumps(messages) == before


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__subclasses__() }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages[0].content + 1 }}",
    "{{ messages.append(1) }}",
])
def test_unsafe_or_failing_templates_raise_chat_template_error(template):
    tok = load_tokenizer(FIXTURES / "llama2_spm", chat_template=template)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_that_does_not_compile_fails_at_load():
    with pytest.raises(ValueError, match="does not compile"):
        load_tokenizer(FIXTURES / "llama2_spm", chat_template="{% if messages %}unterminated")


def test_generation_tag_renders_its_body():
    tok = load_tokenizer(FIXTURES / "llama2_spm",
                         chat_template="{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
                                       "{% endfor %}")
    messages = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    assert tok.apply_chat_template(messages) == "[a][b]"


def test_empty_conversation_is_a_client_error(tokenizers):
    with pytest.raises(ChatTemplateError):
        tokenizers["qwen3_bbpe"].apply_chat_template([])


# --------------------------------------------------------------------------------------- incremental detokenizer

def streamed(tok: Tokenizer, prompt: list[int], generated: list[int], chunks: list[int] | None = None,
             skip_special_tokens: bool = True) -> tuple[list[str], str]:
    """Feeds `generated` in chunks of the given sizes (one token at a time by default): (deltas, flushed tail)."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas, start = [], 0
    for size in chunks or [1] * len(generated):
        deltas.append(detok.add(generated[start:start + size]))
        start += size
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def prompt_text(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    """decode(prompt) up to its last finished character (the generation completes an unfinished one)."""
    for end in range(len(ids), max(len(ids) - 3, 0) - 1, -1):
        text = tok.decode(ids[:end], skip)
        if not text.endswith(FFFD):
            return text
    return tok.decode(ids, skip)


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("name", DIRS)
def test_detokenizer_at_every_prompt_split(tokenizers, name, skip):
    """(b) the deltas add up to decode(prompt + generated) after decode(prompt), and to decode(generated) exactly
    when there is no prompt; (a) no delta holds U+FFFD (a broken character) unless the decode itself does."""
    tok = tokenizers[name]
    for text in TEXTS:
        ids = tok.encode(text)
        for split in range(len(ids) + 1):
            prompt, generated = ids[:split], ids[split:]
            deltas, tail = streamed(tok, prompt, generated, skip_special_tokens=skip)
            full = tok.decode(ids, skip)
            head = prompt_text(tok, prompt, skip)
            assert full.startswith(head)
            assert "".join(deltas) + tail == full[len(head):], (text, split)
            if split == 0:
                assert "".join(deltas) + tail == tok.decode(generated, skip)
            if FFFD not in full:
                assert tail == "" and not any(FFFD in d for d in deltas), (text, split, deltas)


@pytest.mark.parametrize("name", DIRS)
def test_detokenizer_in_random_chunks(tokenizers, name):
    tok, rng = tokenizers[name], random.Random(0)
    for text in TEXTS:
        generated = tok.encode(text, add_special_tokens=False)
        for _ in range(3):
            chunks, left = [], len(generated)
            while left:
                chunks.append(min(left, rng.randint(1, 5)))
                left -= chunks[-1]
            deltas, tail = streamed(tok, [], generated, chunks)
            assert "".join(deltas) + tail == tok.decode(generated)
            assert tail == "" and not any(FFFD in d for d in deltas)


@pytest.mark.parametrize("name", ["llama2_spm", "llama3_bbpe"])
def test_detokenizer_holds_bytes_until_the_character_completes(tokenizers, name):
    tok = tokenizers[name]
    generated = tok.encode("a👍🏽", add_special_tokens=False)  # "a", then one token per byte of the two emoji
    deltas, tail = streamed(tok, [], generated)
    assert deltas == ["a", "", "", "", "👍", "", "", "", "🏽"] and tail == ""


def test_detokenizer_keeps_the_leading_space_after_a_prompt(tokenizers):
    """decode(["▁world"]) alone is "world"; streamed after a prompt it is " world", as it reads in the text."""
    tok = tokenizers["llama2_json"]
    hello, world = tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode([world]) == "world"
    assert "".join(streamed(tok, [1, hello], [world])[0]) == " world"
    assert "".join(streamed(tok, [], [world])[0]) == "world"


def test_detokenizer_special_tokens(tokenizers):
    tok = tokenizers["llama2_json"]
    hello, world = tok.encode("Hello world", add_special_tokens=False)
    generated = [hello, 2, world, 2]
    # Skipped, the BOS of the prompt is no context: the text is decode(generated), first space stripped.
    assert "".join(streamed(tok, [1], generated)[0]) == "Hello world" == tok.decode(generated)
    # Kept, "<s>" is context, so "▁Hello" keeps its space, and "</s>" does not eat the space of "▁world".
    assert "".join(streamed(tok, [1], generated, skip_special_tokens=False)[0]) == " Hello</s> world</s>"


def test_detokenizer_flushes_bytes_that_never_complete(tokenizers):
    tok = tokenizers["llama2_spm"]
    partial = tok.encode("👍", add_special_tokens=False)[:-1]  # "▁", <0xF0>, <0x9F>, <0x91>
    detok = IncrementalDetokenizer(tok, [1])
    assert [detok.add([i]) for i in partial] == ["", "", "", ""]
    assert detok.flush() == FFFD * 3 == tok.decode([1] + partial)  # one per byte, as ByteFallback decodes them
    assert detok.text == FFFD * 3


class DecodeRecorder:
    """A Tokenizer stand-in that records how many ids each decode call is given."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.lengths = tok, []
        self.skipped_special_ids = tok.skipped_special_ids

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("name", ["llama2_spm", "qwen2_bbpe"])
def test_detokenizer_work_per_token_does_not_grow_with_the_output(tokenizers, name):
    tok = tokenizers[name]
    generated = tok.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    recorder = DecodeRecorder(tok)
    detok = IncrementalDetokenizer(recorder, [])
    for token in generated:
        detok.add([token])
    assert len(generated) > 1500
    assert detok.text + detok.flush() == tok.decode(generated)
    assert max(recorder.lengths) <= 12 and len(recorder.lengths) <= 4 * len(generated) + 40
