"""What a request may ask beyond sampling: stop strings, penalties, log-probabilities and structured output,
each checked against the model run by hand (new_sequence().prefill/decode, the rule written out in numpy) or
an independent validator (jsonschema, re), on the demo bundle (byte-level tokenizer) with onnxruntime."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from runtime_bundles import build_demo

from runtime.stop_strings import find_stop, held_back

MAX_SEQ, MAX_INPUT = 64, 16
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    import runtime

    return runtime.load(build_demo(tmp_path_factory.mktemp("opts") / "demo", max_seq=MAX_SEQ, max_input=MAX_INPUT,
                                   max_batch=4), "onnxruntime", threads=1)


def by_hand(rt, prompt, n, transform):
    """Greedy over transform(logits, generated ids) by hand: (ids, logits seen at each step)."""
    seq = rt.new_sequence()
    logits, ids, seen = seq.prefill(rt.encode(prompt)), [], []
    for _ in range(n):
        seen.append(logits)
        ids.append(int(np.argmax(transform(logits, ids))))
        logits = seq.decode(ids[-1])
    seq.close()
    return ids, seen


# ---- stop strings -----------------------------------------------------------------------------
def test_stop_string_helpers_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = "".join(rng.choice(list("abc"), rng.integers(0, 12)))
        stops = ["".join(rng.choice(list("abc"), rng.integers(1, 4))) for _ in range(rng.integers(1, 3))]
        want = min((i for s in stops for i in range(len(text)) if text.startswith(s, i)), default=None)
        assert find_stop(text, 0, stops) == want
        k = max([j for s in stops for j in range(1, len(s)) if j <= len(text) and text.endswith(s[:j])], default=0)
        assert held_back(text, 0, stops) == k, (text, stops)


def test_stop_string_cuts_the_text_and_streaming_never_shows_it(rt):
    """A stop string taken from the middle of the plain greedy text: the answer is that text up to it (not
    included), finish "stop"; the streamed pieces add up to the answer and no piece ever holds the stop's text;
    the token that completed it is the last id."""
    full = rt.generate(PROMPT, 40, stop_ids=[])
    text = full.text
    stop = text[12:15]
    cut = text.find(stop)
    assert 0 < cut and len(set(text)) > 3
    stream = rt.stream(PROMPT, 40, stop_ids=[], stop=[stop, "\x00never"])
    pieces = [t.text for t in stream]
    assert stream.finish_reason == "stop" and stream.text == text[:cut]
    assert "".join(pieces) == text[:cut]
    assert all(stop not in "".join(pieces[:i + 1]) for i in range(len(pieces)))
    assert stream.ids == full.ids[:len(stream.ids)] and len(rt.decode(stream.ids)) >= cut + len(stop) - 1


def test_stop_string_never_reached_streams_everything(rt):
    full = rt.generate(PROMPT, 20, stop_ids=[])
    s = rt.stream(PROMPT, 20, stop_ids=[], stop="\x01\x02")
    assert "".join(t.text for t in s) == full.text and s.finish_reason == "length"


@pytest.mark.parametrize("stop, words", [(["a"] * 5 + ["b"], "at most 4"), ([""], "must not be empty"),
                                         ([3], "list of strings")])
def test_bad_stop_is_refused(rt, stop, words):
    import runtime

    with pytest.raises(runtime.RequestError, match=words) as e:
        rt.request(PROMPT, 5, stop=stop)
    assert e.value.field == "stop"


# ---- penalties ---------------------------------------------------------------------------------
def test_presence_and_frequency_penalties_equal_openai_formula(rt):
    """OpenAI: logit[t] - presence * (count[t] > 0) - frequency * count[t], counts over the generated tokens."""
    pres, freq = 1.5, 0.7

    def penalised(logits, ids):
        c = np.bincount(ids, minlength=logits.size)
        return logits - pres * (c > 0) - freq * c

    ids, _ = by_hand(rt, PROMPT, 24, penalised)
    got = rt.generate(PROMPT, 24, stop_ids=[], presence_penalty=pres, frequency_penalty=freq).ids
    assert got == ids
    assert got != rt.generate(PROMPT, 24, stop_ids=[]).ids, "the penalty changed nothing: the test proves nothing"


def test_repetition_penalty_equals_vllm_rule(rt):
    """vLLM / HF: for every token of prompt or output so far, a positive logit is divided by p, a negative one
    multiplied."""
    p = 1.8
    prompt_ids = rt.encode(PROMPT)

    def penalised(logits, ids):
        seen = np.zeros(logits.size, bool)
        seen[prompt_ids + ids] = True
        return np.where(seen, np.where(logits > 0, logits / p, logits * p), logits)

    ids, _ = by_hand(rt, PROMPT, 24, penalised)
    got = rt.generate(PROMPT, 24, stop_ids=[], repetition_penalty=p).ids
    assert got == ids and got != rt.generate(PROMPT, 24, stop_ids=[]).ids


@pytest.mark.parametrize("kw, field", [(dict(presence_penalty=2.5), "presence_penalty"),
                                       (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                       (dict(repetition_penalty=0), "repetition_penalty")])
def test_bad_penalty_is_refused(rt, kw, field):
    import runtime

    with pytest.raises(runtime.RequestError) as e:
        rt.request(PROMPT, 5, **kw)
    assert e.value.field == field


# ---- logprobs ----------------------------------------------------------------------------------
def test_logprobs_are_the_models_log_softmax(rt):
    """Each token's logprob = log_softmax(the step's logits)[token] in float64; top_logprobs = the 5 most likely
    in order; with temperature and penalties the figures stay the model's (the sampled token may differ from
    the argmax)."""
    ids, seen = by_hand(rt, PROMPT, 12, lambda lg, _: lg)
    g = rt.generate(PROMPT, 12, stop_ids=[], logprobs=5)
    assert g.ids == ids and len(g.tokens) == 12
    for tok, logits in zip(g.tokens, seen):
        z = logits.astype(np.float64)
        lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        assert tok.logprob == pytest.approx(lp[tok.id], abs=1e-9)
        order = np.argsort(-lp, kind="stable")[:5]
        assert [i for i, _ in tok.top_logprobs] == order.tolist()
        assert [v for _, v in tok.top_logprobs] == pytest.approx(lp[order].tolist(), abs=1e-9)
    hot = rt.generate(PROMPT, 12, stop_ids=[], logprobs=0, temperature=1.0, seed=3)
    assert all(t.top_logprobs is None and t.logprob <= 0 for t in hot.tokens)


# ---- structured output -------------------------------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"severity": {"enum": ["minor", "major", "critical"]},
                                      "part": {"type": "string", "maxLength": 12}},
     "required": ["severity", "part"], "additionalProperties": False},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}}, "required": ["count", "ok"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
]


def test_json_schema_output_always_validates(rt):
    """Three schemas x temperatures 0..1.2 x seeds on a random demo model that knows no JSON: every finished
    output parses and validates (jsonschema), and ends by the grammar ("stop"). Runs that hit max-seq first are
    cut by construction and counted apart; most must finish."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    done = cut = 0
    for schema in SCHEMAS:
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        for temp in (0.0, 0.7, 1.2):
            for seed in range(4):
                g = rt.generate("Report:", 48, temperature=temp, seed=seed, response_format=fmt)
                if g.finish_reason != "stop":
                    cut += 1
                    continue
                jsonschema.validate(json.loads(g.text), schema)
                done += 1
    assert done >= 30 and cut <= 6, (done, cut)


def test_regex_and_gbnf_grammar(rt):
    pytest.importorskip("llguidance")
    fmt = {"type": "regex", "regex": "[A-Z]{3}-[0-9]{2}"}
    g = rt.generate("Code:", 30, temperature=1.0, seed=1, response_format=fmt)
    assert g.finish_reason == "stop" and re.fullmatch(r"[A-Z]{3}-[0-9]{2}", g.text), g.text
    gbnf = 'root ::= "part " [a-z]+ " is " ("ok" | "bad")'
    g = rt.generate("x", 40, temperature=0.8, seed=2, response_format={"type": "grammar", "grammar": gbnf})
    assert g.finish_reason == "stop" and re.fullmatch(r"part [a-z]+ is (ok|bad)", g.text), g.text


def test_structured_output_in_the_engine_batch_equals_alone(rt):
    """Constrained requests mixed with plain ones in the continuous-batching engine: each answer equals the
    same request run alone (the mask is per request state)."""
    pytest.importorskip("llguidance")
    from runtime.engine import Engine, EngineConfig

    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
    reqs = [dict(response_format=fmt), dict(), dict(response_format={"type": "json_object"}, temperature=0.9, seed=4),
            dict(stop=["e"]), dict(response_format=fmt, temperature=1.1, seed=9)]
    alone = [rt.generate("Report:", 40, **kw) for kw in reqs]
    with Engine(rt, EngineConfig(min_hit_rate=0.0, max_kv_noise=None)) as eng:
        got = [r.result(60) for r in [eng.submit("Report:", 40, **kw) for kw in reqs]]
    assert [(g.ids, g.text, g.finish_reason) for g in got] == [(a.ids, a.text, a.finish_reason) for a in alone]


def test_warm_format_compiles_before_the_first_request(rt, monkeypatch):
    """warm_format makes the grammar engine's tokenizer and compiles the format: the first request of that format
    then makes and compiles nothing, and answers as a runtime that was not warmed; a bad format is refused as a
    request's is."""
    pytest.importorskip("llguidance")
    import runtime
    from runtime import constrained

    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
    want = rt.generate("Report:", 40, response_format=fmt)
    fresh = runtime.load(rt.bundle, "onnxruntime", threads=1)
    with pytest.raises(runtime.RequestError, match="does not compile") as e:
        fresh.warm_format({"type": "regex", "regex": "(("})
    assert e.value.field == "response_format"
    fresh.warm_format(fmt)
    made = []
    monkeypatch.setattr(constrained, "grammar_of", lambda f: made.append("grammar"))
    monkeypatch.setattr(constrained.GrammarTokenizer, "from_json", lambda *a: made.append("tokenizer"))
    got = fresh.generate("Report:", 40, response_format=fmt)
    assert made == [] and (got.ids, got.text, got.finish_reason) == (want.ids, want.text, want.finish_reason)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": 3}}},
     "does not compile"),
    ({"type": "regex", "regex": "(("}, "does not compile"),
    ({"type": "grammar", "grammar": "root ::= undefined_rule"}, "does not compile"),
    ({"type": "yaml"}, "type must be one of"),
    ("json", "expected an object"),
])
def test_bad_response_format_is_one_error_naming_it(rt, fmt, words):
    pytest.importorskip("llguidance")
    import runtime

    with pytest.raises(runtime.RequestError, match=words) as e:
        rt.request("x", 5, response_format=fmt)
    assert e.value.field == "response_format"


def test_cli_json_schema_stop_and_penalties(rt, tmp_path):
    """`runtime generate --json-schema FILE`: the printed answer validates; a schema that does not compile or a
    file that is not JSON is exit 2 with one error line naming the flag; --stop and penalties reach the
    request (the text equals the Python API's)."""
    import subprocess
    import sys

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[1]))

    def gen(*flags):
        return subprocess.run([sys.executable, "-m", "runtime", "generate", str(rt.bundle), "--prompt", "Report:",
                               "--max-new-tokens", "40", *flags], capture_output=True, text=True, timeout=120)

    r = gen("--json-schema", str(schema), "--temperature", "0.8", "--seed", "3")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout.removeprefix("Report:").strip()), SCHEMAS[1])
    want = rt.generate("Report:", 40, stop=["e"], presence_penalty=1.0).text
    r = gen("--stop", "e", "--presence-penalty", "1.0")
    assert r.returncode == 0 and r.stdout == "Report:" + want + "\n"
    for text, words in (('{"type": "object", "properties": 3}', "does not compile"), ("{nope", "Expecting")):
        schema.write_text(text)
        r = gen("--json-schema", str(schema))
        errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
        assert r.returncode == 2 and len(errors) == 1 and "--json-schema" in errors[0] and words in errors[0], r.stderr


# ---- the options as one value ------------------------------------------------------------------------------
def test_request_options_equal_the_keywords_and_keywords_go_over_them(rt):
    """`options=RequestOptions(...)` gives the tokens the same keywords give (Runtime.generate, chat-free request,
    Engine.submit), keywords given beside it replace its fields, an unknown keyword is a TypeError naming it, and a
    bad sampling field is the first error, before the prompt is looked at."""
    import runtime
    from runtime.engine import Engine, EngineConfig

    kw = dict(temperature=0.9, top_k=20, seed=4, presence_penalty=0.5, stop_ids=[], logprobs=2)
    want = rt.generate(PROMPT, 12, **kw)
    opts = runtime.RequestOptions(**kw)
    got = rt.generate(PROMPT, 12, opts)
    assert (got.ids, got.tokens) == (want.ids, want.tokens)
    assert rt.generate(PROMPT, 12, runtime.RequestOptions(**{**kw, "seed": 9}), seed=4).ids == want.ids
    with Engine(rt, EngineConfig(min_hit_rate=0.0, max_kv_noise=None)) as eng:
        assert eng.submit(PROMPT, 12, options=opts).result(30).ids == want.ids
    with pytest.raises(TypeError, match="'top_n'"):
        rt.request(PROMPT, 4, top_n=3)
    with pytest.raises(runtime.RequestError) as e:
        rt.request([rt.vocab_size + 5], 4, temperature=-1.0)  # the prompt is bad too: temperature is named first
    assert e.value.field == "temperature"


def test_backend_registry_opens_each_name_and_auto_without_an_engine_is_onnxruntime(rt):
    """runtime.loader's table: every name `load` accepts is in it (auto aside), `auto` on a bundle without engine.plan
    opens ONNX Runtime, and loading ONNX Runtime by name never imports the TensorRT backend's module."""
    import subprocess
    import sys

    from runtime.loader import BACKEND_OPENERS, BACKENDS, backend_name

    assert BACKENDS == ("auto", "onnxruntime", "tensorrt", "reference") and set(BACKEND_OPENERS) == set(BACKENDS[1:])
    assert backend_name("auto", rt.bundle) == "onnxruntime" and backend_name("reference", rt.bundle) == "reference"
    code = ("import sys, runtime; rt = runtime.load(sys.argv[1], 'onnxruntime', threads=1); "
            "print(rt.backend.name, 'runtime.trt_backend' in sys.modules, 'tensorrt' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(rt.bundle)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["onnxruntime", "False", "False"], r.stderr
