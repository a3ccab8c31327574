"""real.model.tokenizer: built from the bundled GGUF's metadata, checked against transformers' own
GGUF tokenizer conversion and chat-template rendering."""

from __future__ import annotations

import pytest

from real.model.tokenizer import CHATML, Tokenizer, render_chat_template
from tests.helpers.real_models import bundled, hf_tokenizer

TEXTS = [
    "Hello world, how are you?",
    "  leading spaces, trailing  \n\n\tand tabs\r\n",
    "Numbers: 1234567890, 3.14159, -42, 1e-5 and 2024-11-22.",
    "def f(x):\n    return x ** 2  # square\n",
    "Unicode: naïve café, Ελληνικά, 日本語のテキスト, emoji 🤖🎨, math ∑∫√.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Mixed<|endoftext|>special tokens inside<|im_end|>text",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
]

pytestmark = pytest.mark.model


def tokenizer() -> Tokenizer:
    return bundled()[1]


def test_round_trip_and_special_tokens() -> None:
    tok = tokenizer()
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert len(tok.encode("12345")) == 5  # SmolLM splits digits
    assert tok.decode(tok.encode("<|im_start|>hi"), skip_special_tokens=True) == "hi"


def test_ids_match_transformers_gguf_tokenizer() -> None:
    tok = tokenizer()
    hf_tok = hf_tokenizer()
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True), text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids)


def test_chat_template_matches_transformers() -> None:
    tok = tokenizer()
    hf_tok = hf_tokenizer()
    for chat in CHATS:
        for gen in (True, False):
            ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
            ref = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours == ref
            assert tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True) == tok.encode(ref)
    # SmolLM2's template adds its default system prompt when none is given
    assert tok.apply_chat_template(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful AI")


def test_from_dir_equals_from_gguf(tmp_path) -> None:
    tok = tokenizer()
    hf_tok = hf_tokenizer()
    hf_tok.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == tok.encode(text)
    assert from_dir.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])
    assert 2 in from_dir.eos_token_ids


def test_chatml_fallback_renders_without_a_template() -> None:
    text = render_chat_template(CHATML, CHATS[0], add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_a_gguf_tokenizer_is_cached_as_json_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch) -> None:
    """from_gguf keeps the built tokenizer as JSON (reading the vocabulary through gguf takes
    seconds): a second load does not open the .gguf and tokenizes identically; a damaged cache
    is rebuilt; a changed file gets another key."""
    import os
    import shutil

    import real.model.paths
    import real.model.tokenizer as rt
    from real.model.paths import bundled_gguf_path

    gguf = tmp_path / "model.gguf"
    shutil.copyfile(bundled_gguf_path(), gguf)
    monkeypatch.setattr(rt, "_cache_file", lambda p: tmp_path / f"{p.stem}-{p.stat().st_mtime_ns}.json")
    built = Tokenizer.from_gguf(gguf)
    cache = rt._cache_file(gguf)
    assert cache.is_file()

    opened = []
    real_open = real.model.paths.open_gguf
    monkeypatch.setattr(real.model.paths, "open_gguf", lambda p: opened.append(p) or real_open(p))
    again = Tokenizer.from_gguf(gguf)
    assert opened == []  # from the cache
    for text in TEXTS:
        assert again.encode(text) == built.encode(text)
    assert (again.eos_token_ids, again.bos_token_id, again.add_bos, again.chat_template) == \
        (built.eos_token_ids, built.bos_token_id, built.add_bos, built.chat_template)

    cache.write_text('{"tokenizer": "not a tokenizer"')  # damaged
    assert Tokenizer.from_gguf(gguf).encode(TEXTS[0]) == built.encode(TEXTS[0]) and len(opened) == 1
    os.utime(gguf, ns=(1, 1))  # another file at the same path
    assert rt._cache_file(gguf) != cache
    Tokenizer.from_gguf(gguf)
    assert len(opened) == 2


def test_the_cache_key_follows_path_size_and_mtime(tmp_path) -> None:
    import os

    from real.model.tokenizer import _cache_file

    f = tmp_path / "a.gguf"
    f.write_bytes(b"x")
    key = _cache_file(f)
    assert _cache_file(f) == key and key.name.startswith("a-")
    os.utime(f, ns=(5, 5))
    assert _cache_file(f) != key
