"""real.model.tokenizer: built from the bundled GGUF's metadata, checked against transformers' own
GGUF tokenizer conversion and chat-template rendering. Converting the GGUF with transformers
takes ~8 s on 2 cores, so the default run compares with its output as recorded (``HF_IDS``,
``HF_CHATS``); the slow tests compare with a live conversion and check the recordings."""

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

# transformers' tokenizer converted from the bundled GGUF: encode(text, add_special_tokens=True)
# of each of TEXTS (its decode gives the text back) ...
HF_IDS = [
    [19556, 905, 28, 638, 359, 346, 47],
    [216, 2899, 5600, 28, 35079, 256, 1116, 197, 397, 29416, 2738],
    [39006, 42, 216, 33, 34, 35, 36, 37, 38, 39, 40, 41, 32, 28, 216, 35, 30, 33, 36, 33, 37, 41, 28, 731,
     36, 34, 28, 216, 33, 85, 29, 37, 284, 216, 34, 32, 34, 36, 29, 33, 33, 29, 34, 34, 30],
    [1604, 275, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34, 216, 907, 5222, 198],
    [3706, 15817, 42, 15486, 46494, 37366, 28, 5664, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112,
     28, 17097, 241, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 28,
     649, 33777, 15107, 114, 240, 10813, 232, 118, 28, 4119, 19995, 235, 22052, 121, 22052, 244, 30],
    [1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198],
    [61, 13609, 0, 19159, 17837, 2972, 2, 2692],
    [],
]
# ... and apply_chat_template(CHATS[i], tokenize=False, add_generation_prompt=gen) by (i, gen)
_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
_BRIEF = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
          "<|im_start|>assistant\nBlue.<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n")
HF_CHATS = {
    (0, False): _SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n",
    (0, True): _SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    (1, False): _BRIEF,
    (1, True): _BRIEF + "<|im_start|>assistant\n",
}

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


def test_ids_match_the_recorded_transformers_ids() -> None:
    """HF_IDS; the slow test below checks them against a live conversion."""
    tok = tokenizer()
    assert len(HF_IDS) == len(TEXTS)
    for text, ids in zip(TEXTS, HF_IDS):
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text  # transformers' decode of these ids, as recorded


@pytest.mark.slow  # transformers' GGUF conversion, ~8 s; by default the test above holds us to HF_IDS
def test_ids_match_transformers_gguf_tokenizer() -> None:
    tok = tokenizer()
    hf_tok = hf_tokenizer()
    for text, recorded in zip(TEXTS, HF_IDS, strict=True):
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True), text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids)
        assert hf_tok.encode(text, add_special_tokens=True) == recorded and hf_tok.decode(ids) == text


def _check_chats(tok: Tokenizer, reference) -> None:  # type: ignore[no-untyped-def]
    for i, chat in enumerate(CHATS):
        for gen in (True, False):
            ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
            ref = reference(i, chat, gen)
            assert ours == ref
            assert tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True) == tok.encode(ref)
    # SmolLM2's template adds its default system prompt when none is given
    assert tok.apply_chat_template(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful AI")


def test_chat_template_matches_the_recorded_transformers_rendering() -> None:
    """HF_CHATS; the slow test below checks them against a live conversion."""
    _check_chats(tokenizer(), lambda i, chat, gen: HF_CHATS[i, gen])


@pytest.mark.slow  # transformers' GGUF conversion; by default the test above holds us to HF_CHATS
def test_chat_template_matches_transformers() -> None:
    hf_tok = hf_tokenizer()

    def live(i: int, chat, gen: bool) -> str:  # type: ignore[no-untyped-def]
        ref = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert ref == HF_CHATS[i, gen]  # the default test's recording
        return ref

    _check_chats(tokenizer(), live)


def test_from_dir_equals_from_gguf(tmp_path) -> None:
    """A checkpoint directory as transformers saves it (tokenizer.json, tokenizer_config.json,
    the chat template) holding the bundled tokenizer reads back as from_gguf built it. The
    directory is saved from our tokenizer's own BPE (transformers' conversion of the GGUF is
    what the tests above compare with)."""
    from transformers import PreTrainedTokenizerFast

    tok = tokenizer()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token="<|im_start|>",
                                     eos_token="<|im_end|>", chat_template=tok.chat_template)
    hf_tok.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == tok.encode(text)
    assert from_dir.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])
    assert 2 in from_dir.eos_token_ids


def test_chatml_fallback_renders_without_a_template() -> None:
    text = render_chat_template(CHATML, CHATS[0], add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def add_tiny_tokenizer(w) -> int:  # type: ignore[no-untyped-def]  # w: gguf.GGUFWriter
    """A byte-level BPE tokenizer in ``w``'s metadata: the 256 byte symbols, three merges,
    ChatML's special tokens and a chat template. Returns the vocabulary size."""
    from tokenizers.pre_tokenizers import ByteLevel

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*special, *sorted(ByteLevel.alphabet()), "Ġt", "he", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(special) + [1] * (len(tokens) - len(special)))  # 3: control
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    return len(tokens)


def tokenizer_only_gguf(path) -> None:  # type: ignore[no-untyped-def]
    """A .gguf holding ``add_tiny_tokenizer``'s tokenizer and no tensors: gguf reads it in
    milliseconds (the bundled 49k-token vocabulary takes seconds, three times in the test below)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    add_tiny_tokenizer(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_tokenizer_is_cached_as_json_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch) -> None:
    """from_gguf keeps the built tokenizer as JSON (reading the vocabulary through gguf takes
    seconds): a second load does not open the .gguf and tokenizes identically; a damaged cache
    is rebuilt; a changed file gets another key."""
    import os

    import real.model.paths
    import real.model.tokenizer as rt

    gguf = tmp_path / "model.gguf"
    tokenizer_only_gguf(gguf)
    monkeypatch.setattr(rt, "_cache_file", lambda p: tmp_path / f"{p.stem}-{p.stat().st_mtime_ns}.json")
    built = Tokenizer.from_gguf(gguf)
    assert built.encode(" the") == [len(built.backend.get_vocab()) - 1]  # the merges were read
    assert (built.bos_token_id, built.eos_token_ids, built.chat_template) == (1, [2], CHATML)
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
