"""Decoded text and chat (issues 8 and 12): the streamed text is text(prompt + new) - text(prompt) with
the leading space kept and UTF-8 held back until a character completes; chat templates render as
transformers' apply_chat_template. References: SentencePiece itself (stories260K's tok512.model), the
`tokenizers` decode of the whole sequence, transformers."""

from __future__ import annotations

import pytest
from conftest import DATA
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_bundles import CHATML, MIXED_TEXT, build_demo, byte_bpe_json, with_text_files

from runtime.bundle import BundleError
from runtime.text import (
    REPLACEMENT,
    ChatTemplateError,
    Detokenizer,
    TokenizerConfig,
    compile_chat_template,
    render_chat,
)

TOK512_BIN, TOK512_MODEL = DATA / "tok512.bin", DATA / "tok512.model"
SMOLLM = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 384  # the demo model's
SPECIALS = ("<|im_start|>", "<|im_end|>")


def stream_text(decode, prompt, new):
    """(pieces, flushed tail) of a Detokenizer fed `new` after `prompt`."""
    d = Detokenizer(decode, prompt)
    pieces = [d.add(t) for t in new]
    tail = d.flush()
    assert "".join(pieces) + tail == d.text
    return pieces, tail


@pytest.fixture(scope="module")
def stories():
    if not TOK512_BIN.is_file():
        pytest.skip(f"real data not found at {DATA}")
    sentencepiece = pytest.importorskip("sentencepiece")
    from gsm.tokenizer import llama2c_tokenizer_json, tokenizer_from_json

    return tokenizer_from_json(llama2c_tokenizer_json(TOK512_BIN)), sentencepiece.SentencePieceProcessor(
        model_file=str(TOK512_MODEL))


def test_first_generated_token_keeps_its_space_stories260k(stories):
    tok, sp = stories
    ids = [1, *sp.encode("Once upon a time")]  # SentencePiece's own ids for the reference text
    assert tok.decode(ids[-1:]) == "time"  # the bug: decoding the new token alone drops its space
    pieces, tail = stream_text(tok.decode, ids[:-1], ids[-1:])
    assert pieces == [" time"] and tail == ""
    pieces, _ = stream_text(tok.decode, ids[:1], ids[1:])  # right after BOS: no space before the text
    assert "".join(pieces) == "Once upon a time" == sp.decode(ids)


def test_space_only_tokens_keep_their_spaces_stories260k(stories):
    """Sampled ids need not be a canonical encoding: lone "▁" pieces before "▁upon" must not be lost to
    the decoder's start-of-text space stripping when the window starts at them."""
    tok, sp = stories
    space, upon = sp.piece_to_id("\u2581"), sp.piece_to_id("\u2581upon")
    for new in ([space, upon], [space, space, upon], [space, space, space, upon, space, upon]):
        prompt = [1, *sp.encode("Once")]
        pieces, tail = stream_text(tok.decode, prompt, new)
        assert "".join(pieces) + tail == sp.decode(prompt + new)[len("Once"):], new


@pytest.mark.parametrize("text", ["Once upon a time, there was a little dog named Max.  He liked to run.\nThe end.",
                                  MIXED_TEXT])
def test_stream_equals_whole_decode_stories260k(stories, text):
    """Every split of the sequence into prompt + generated: the pieces join to SentencePiece's decode
    of the whole minus its decode of the prompt; no piece before the last ends inside a character."""
    tok, sp = stories
    ids = [1, *sp.encode(text)]
    assert tok.encode(text).ids == ids[1:]
    full, checked = sp.decode(ids), 0
    for k in range(1, len(ids)):
        pre = sp.decode(ids[:k])
        if not full.startswith(pre):  # the prompt ends inside a character: no defined suffix
            continue
        pieces, tail = stream_text(tok.decode, ids[:k], ids[k:])
        assert "".join(pieces) + tail == full[len(pre):], k
        assert not any(p.endswith(REPLACEMENT) for p in pieces)
        checked += 1
    assert checked > len(ids) // 2


def test_stream_holds_back_split_characters_byte_fallback():
    """The demo model's tokenizer spells every character in UTF-8 byte tokens: a 4-byte emoji is
    emitted whole by the token that completes it."""
    from gsm.tokenizer import byte_level_tokenizer_json, tokenizer_from_json

    tok = tokenizer_from_json(byte_level_tokenizer_json(VOCAB))
    ids = [1, *tok.encode(MIXED_TEXT).ids]
    assert len(ids) == len(MIXED_TEXT.encode()) + 1
    for k in (1, 9, 30):
        pieces, tail = stream_text(tok.decode, ids[:k], ids[k:])
        assert "".join(pieces) == tok.decode(ids)[len(tok.decode(ids[:k])):] and tail == ""
    pieces, _ = stream_text(tok.decode, [1], tok.encode("a😀").ids)
    assert pieces == ["a", "", "", "", "😀"]


@pytest.fixture(scope="module")
def byte_bpe():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(byte_bpe_json(VOCAB, SPECIALS))


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
       new=st.lists(st.integers(0, VOCAB - 1), max_size=30))
def test_stream_equals_whole_decode_byte_level_bpe(byte_bpe, prompt, new):
    """Random ids of a GPT-2 style byte-level BPE (characters split across byte tokens, invalid bytes)."""
    pre, full = byte_bpe.decode(prompt), byte_bpe.decode(prompt + new)
    if pre.endswith(REPLACEMENT) or not full.startswith(pre):
        return  # the prompt itself ends inside a character
    pieces, tail = stream_text(byte_bpe.decode, prompt, new)
    assert "".join(pieces) + tail == full[len(pre):]
    assert not any(p.endswith(REPLACEMENT) for p in pieces)


# --- through a bundle ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    d = tmp_path_factory.mktemp("rttext")
    demo = build_demo(d / "demo")
    chat = with_text_files(demo, d / "chat", tokenizer_json=byte_bpe_json(VOCAB, SPECIALS),
                           tokenizer_config={"chat_template": CHATML, "bos_token": "<s>",
                                             "eos_token": {"content": "<|im_end|>", "special": True},
                                             "add_bos_token": False})
    return {"demo": demo, "chat": chat}


def test_generation_text_is_what_follows_the_prompt(bundles):
    import runtime

    rt = runtime.load(bundles["chat"], "onnxruntime", threads=1)
    tok = rt.tokenizer
    for seed in range(4):
        prompt = rt.encode("Once upon a time, a café")
        s = rt.stream(prompt, 24, temperature=1.0, seed=seed, stop_ids=[])
        pieces = [t.text for t in s]
        g = rt.generate(prompt, 24, temperature=1.0, seed=seed, stop_ids=[])
        assert g.ids == s.ids and g.text == s.text
        whole = tok.decode(prompt + g.ids)
        assert g.text == whole[len(tok.decode(prompt)):]
        assert "".join(pieces) == g.text and g.finish_reason == "length"


def test_encode_follows_add_bos_token(bundles):
    import runtime

    demo, chat = (runtime.load(bundles[k], "onnxruntime", threads=1) for k in ("demo", "chat"))
    assert demo.encode("hi") == [1, *demo.tokenizer.encode("hi").ids]  # no tokenizer_config.json: BOS as before
    assert chat.encode("hi") == chat.tokenizer.encode("hi").ids and chat.tokenizer.encode("hi").ids[0] != 1
    assert chat.encode("<|im_end|>") != [chat.tokenizer.token_to_id("<|im_end|>")]  # plain text stays text


def test_chat_ids_and_stops_match_transformers(bundles):
    transformers = pytest.importorskip("transformers")
    import runtime

    rt = runtime.load(bundles["chat"], "onnxruntime", threads=1)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bundles["chat"] / "tokenizer.json"),
                                               bos_token="<s>", eos_token="<|im_end|>", chat_template=CHATML)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> café?"}]
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rt.chat_ids(msgs) == ref(text, add_special_tokens=False)["input_ids"]
    assert rt.chat_ids(msgs)[0] == ref.convert_tokens_to_ids("<|im_start|>")  # a control token, not text
    assert rt.codec.chat_stop_ids() == sorted({2, ref.convert_tokens_to_ids("<|im_end|>")})
    g = rt.chat(msgs, 6, temperature=1.0, seed=0)
    assert not set(g.ids) & set(rt.codec.chat_stop_ids()) and g.prompt_ids == rt.chat_ids(msgs)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        runtime.load(bundles["demo"], "onnxruntime", threads=1).chat(msgs)


@pytest.fixture(scope="module")
def smollm_template():
    if not SMOLLM.is_file():
        pytest.skip(f"real data not found at {DATA}")
    gguf = pytest.importorskip("gguf")
    field = gguf.GGUFReader(str(SMOLLM)).fields["tokenizer.chat_template"]
    return field.contents()


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a <b>story</b> with \"quotes\" & ünïcödé 😀\n\nTwo lines."}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn", "system-multi-turn"])
def test_smollm2_template_renders_as_transformers(byte_bpe, smollm_template, messages):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_bpe, bos_token="<|im_start|>",
                                               eos_token="<|im_end|>", chat_template=smollm_template)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    got = render_chat(compile_chat_template(smollm_template), messages,
                      {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    assert got == want and got.endswith("<|im_start|>assistant\n")


def test_tojson_and_raise_exception_as_transformers(byte_bpe):
    transformers = pytest.importorskip("transformers")
    tmpl = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
            "{{ bos_token }}{% for m in messages %}\n  {{ m | tojson }}\n{% endfor %}"
            "{% if add_generation_prompt %}<go>{% endif %}")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_bpe, bos_token="<s>", eos_token="</s>",
                                               chat_template=tmpl)
    msgs = [{"role": "user", "content": "<b>é & \"x\"</b>"}]
    assert render_chat(compile_chat_template(tmpl), msgs, {"bos_token": "<s>", "eos_token": "</s>"}) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="first message must be the user"):
        render_chat(compile_chat_template(tmpl), [{"role": "system", "content": "x"}], {})


def test_tokenizer_config_forms():
    c = TokenizerConfig.from_json({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
                                   "chat_template": [{"name": "tool_use", "template": "T"},
                                                     {"name": "default", "template": "D"}]}, "x")
    assert c.add_bos_token and c.chat_template == "D" and c.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert not TokenizerConfig.from_json({"add_bos_token": False}, "x").add_bos_token
    with pytest.raises(BundleError, match="add_bos_token must be true or false"):
        TokenizerConfig.from_json({"add_bos_token": "no"}, "x")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_chat_template("{% for %}")
